"""A/B round 2: gated-act block/warps; decode attention expand/tile/warps/stages/split."""
import itertools, json, os, torch
from qfuse.bench import common
from qfuse.bench.attention import _make_kv, _nbytes
from qfuse.kernels.decode_attention import decode_attention_quantized_kv as attn
from qfuse.kernels.gated_act import gated_act_forward, gated_act_backward
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
OUT=os.environ.get("OUT","/tmp")
copy=common.copy_bandwidth_gbs(); print("copy", copy, flush=True)
rows=[]
# gated act
M,I=8192,15360; n=M*I
a=torch.randn(M,I,device="cuda",dtype=torch.bfloat16)*3; b=torch.randn_like(a); g=torch.randn_like(a)
ref=F.gelu(a,approximate="tanh")*b
for blk,nw in itertools.product((1024,2048,4096,8192),(4,8,16)):
    if blk//(32*nw)<1: continue
    out=gated_act_forward(a,b,"gelu_tanh",_block=blk,_num_warps=nw); assert torch.equal(out,ref)
    t=common.time_graph_us(lambda: gated_act_forward(a,b,"gelu_tanh",_block=blk,_num_warps=nw),[()])
    tb=common.time_graph_us(lambda: gated_act_backward(a,b,g,"gelu_tanh",_block=blk,_num_warps=nw),[()])
    rows.append(dict(k="act",cfg=f"blk{blk} w{nw}",fwd_us=t,fwd_share=3*n*2/t/1e3/copy,bwd_us=tb,bwd_share=5*n*2/tb/1e3/copy))
    print(rows[-1],flush=True)
tc=torch.compile(lambda a,b: F.gelu(a,approximate="tanh")*b)
t=common.time_graph_us(lambda: tc(a,b),[()]); rows.append(dict(k="act",cfg="torch.compile",fwd_us=t,fwd_share=3*n*2/t/1e3/copy)); print(rows[-1])
del a,b,g,ref
for (Hq,Hkv,D),N,B in [((16,8,256),131072,1),((16,8,256),8192,1),((32,8,128),131072,1),((32,8,128),8192,1),((16,8,256),32768,8)]:
    q=torch.randn(B,Hq,D,device="cuda",dtype=torch.bfloat16); L=torch.full((B,),N,dtype=torch.int32,device="cuda")
    for kind in ("bf16","kv4","kv8"):
        kv=_make_kv(kind,B,Hkv,N,D); nb=sum(_nbytes(t) for t in kv)
        sets=[kv]+[_make_kv(kind,B,Hkv,N,D) for _ in range(common.n_rotations(nb,cap=64)-1)]
        if kind=="bf16":
            def sd(k,v):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q[:,:,None],k,v,enable_gqa=True)
            t=common.time_graph_us(sd,sets); rows.append(dict(k="attn",D=D,N=N,B=B,cfg="sdpa-flash bf16",us=t,share=nb/t/1e3/copy))
        cfgs=[(0,None,4,2,256)] if kind!="bf16" else []
        cfgs+=[(1,bn,nw,ns,sp) for bn,nw,ns,sp in itertools.product((32,64),(4,8),(2,3),(256,1024))]
        for ex,bn,nw,ns,sp in cfgs:
            try:
                t=common.time_graph_us(lambda k,v: attn(q,k,v,L,0.1,_expand=ex,_block_n=bn,_num_warps=nw,_num_stages=ns,_split=sp),sets)
                rows.append(dict(k="attn",D=D,N=N,B=B,cfg=f"{kind} ex{ex} bn{bn} w{nw} s{ns} sp{sp}",us=t,share=nb/t/1e3/copy))
            except Exception as e:
                rows.append(dict(k="attn",D=D,N=N,B=B,cfg=f"{kind} ex{ex} bn{bn} w{nw} s{ns} sp{sp}",error=str(e)[:80]))
        best=min((r for r in rows if r.get("D")==D and r.get("N")==N and r.get("B")==B and r["cfg"].startswith(kind) and "us" in r),key=lambda r:r["us"],default=None)
        print("BEST",D,N,B,best,flush=True)
        del sets,kv; torch.cuda.empty_cache()
json.dump(rows,open(OUT+"/ab2.json","w"),indent=1)
common.print_table([r for r in rows if r["k"]=="act"],["cfg","fwd_us","fwd_share","bwd_us","bwd_share"])
