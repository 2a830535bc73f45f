"""A/B round 3: gated-act EVEN/evict; decode attention cast-early, final defaults."""
import itertools, json, os, torch
from qfuse.bench import common
from qfuse.bench.attention import _make_kv, _nbytes
from qfuse.kernels.decode_attention import decode_attention_quantized_kv as attn
from qfuse.kernels.gated_act import gated_act_forward
import torch.nn.functional as F
OUT=os.environ.get("OUT","/tmp")
copy=common.copy_bandwidth_gbs(); print("copy", copy, flush=True)
rows=[]
M,I=8192,15360; n=M*I
sets=[(torch.randn(M,I,device="cuda",dtype=torch.bfloat16)*3, torch.randn(M,I,device="cuda",dtype=torch.bfloat16)) for _ in range(2)]
ref=F.gelu(sets[0][0],approximate="tanh")*sets[0][1]
for rep in range(2):
  for blk,nw,ev in itertools.product((1024,2048,4096),(4,8),("","evict_first")):
    out=gated_act_forward(*sets[0],"gelu_tanh",_block=blk,_num_warps=nw,_evict=ev); assert torch.equal(out,ref)
    t=common.time_graph_us(lambda a,b: gated_act_forward(a,b,"gelu_tanh",_block=blk,_num_warps=nw,_evict=ev),sets)
    rows.append(dict(k="act",cfg=f"blk{blk} w{nw} {ev}",fwd_us=t,fwd_share=3*n*2/t/1e3/copy))
  tc=torch.compile(lambda a,b: F.gelu(a,approximate="tanh")*b)
  t=common.time_graph_us(tc,sets); rows.append(dict(k="act",cfg="torch.compile",fwd_us=t,fwd_share=3*n*2/t/1e3/copy))
common.print_table(rows,["cfg","fwd_us","fwd_share"])
del sets,ref
for (Hq,Hkv,D),N,B in [((16,8,256),131072,1),((16,8,256),8192,1),((32,8,128),131072,1)]:
    q=torch.randn(B,Hq,D,device="cuda",dtype=torch.bfloat16); L=torch.full((B,),N,dtype=torch.int32,device="cuda")
    for kind in ("kv4","kv8"):
        kv=_make_kv(kind,B,Hkv,N,D); nb=sum(_nbytes(t) for t in kv)
        sets=[kv]+[_make_kv(kind,B,Hkv,N,D) for _ in range(common.n_rotations(nb,cap=64)-1)]
        for c,bn,nw,ns,sp in itertools.product((False,True),(16,32,64),(4,8),(2,3),(256,1024)):
            t=common.time_graph_us(lambda k,v: attn(q,k,v,L,0.1,_expand=1,_cast=c,_block_n=bn,_num_warps=nw,_num_stages=ns,_split=sp),sets)
            rows.append(dict(k="attn",D=D,N=N,B=B,cfg=f"{kind} cast{int(c)} bn{bn} w{nw} s{ns} sp{sp}",us=t,share=nb/t/1e3/copy))
        best=sorted((r for r in rows if r.get("D")==D and r.get("N")==N and r.get("B")==B and r["cfg"].startswith(kind)),key=lambda r:r["us"])[:3]
        for r in best: print("BEST",r,flush=True)
        del sets,kv; torch.cuda.empty_cache()
json.dump(rows,open(OUT+"/ab3.json","w"),indent=1)
