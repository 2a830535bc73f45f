"""A/B: decode attention v1 (dequantize tile then dot) vs v2 (scales outside the dots)."""
import itertools, torch, json, os
from qfuse.bench import common
from qfuse.bench.attention import _make_kv, _nbytes
from qfuse.kernels.decode_attention import decode_attention_quantized_kv
from qfuse.kernels.decode_attention_v2 import decode_attention_v2
from tests.attention_cases import make_case, errors
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# correctness of v2 on GPU (bf16)
for D,Hq,Hkv,bits in [(256,16,8,4),(128,32,8,8),(512,8,1,4),(64,8,8,4)]:
    q,k,v,L = make_case(3,Hq,Hkv,D,5000,[4999,97,1025],bits,torch.bfloat16,"cuda")
    out=decode_attention_v2(q,k,v,L,D**-0.5)
    e,ec=errors(out,q,k,v,L,D**-0.5)
    print("v2 correctness", D,Hq,Hkv,bits, e, ec, "OK" if e<=2*ec and not out.isnan().any() else "FAIL")
copy=common.copy_bandwidth_gbs(); print("copy", copy)
rows=[]
for (Hq,Hkv,D),N,B in [((16,8,256),131072,1),((16,8,256),8192,1),((32,8,128),131072,1),((32,8,128),8192,1),((16,8,256),32768,8)]:
    q=torch.randn(B,Hq,D,device="cuda",dtype=torch.bfloat16); L=torch.full((B,),N,dtype=torch.int32,device="cuda")
    dense=_make_kv("bf16",B,Hkv,N,D); nb=sum(_nbytes(t) for t in dense)
    reps=common.n_rotations(nb,cap=64); dsets=[dense]+[_make_kv("bf16",B,Hkv,N,D) for _ in range(reps-1)]
    def sd(k,v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q[:,:,None],k,v,enable_gqa=True)
    t=common.time_graph_us(sd,dsets); rows.append(dict(Hq=Hq,D=D,N=N,B=B,v="sdpa-flash bf16",us=t,GBps=nb/t/1e3))
    t=common.time_graph_us(lambda k,v: decode_attention_quantized_kv(q,k,v,L,0.1),dsets); rows.append(dict(Hq=Hq,D=D,N=N,B=B,v="v1 bf16",us=t,GBps=nb/t/1e3))
    del dsets,dense
    for bits in (4,8):
        kv=_make_kv(f"kv{bits}",B,Hkv,N,D); nb=sum(_nbytes(t) for t in kv)
        reps=common.n_rotations(nb,cap=64); sets=[kv]+[_make_kv(f"kv{bits}",B,Hkv,N,D) for _ in range(reps-1)]
        t=common.time_graph_us(lambda k,v: decode_attention_quantized_kv(q,k,v,L,0.1),sets); rows.append(dict(Hq=Hq,D=D,N=N,B=B,v=f"v1 kv{bits}",us=t,GBps=nb/t/1e3,share=nb/t/1e3/copy))
        for bn,nw,ns in itertools.product((16,32,64),(4,8),(2,3)):
            if bn*D>32768: continue
            try:
                t=common.time_graph_us(lambda k,v: decode_attention_v2(q,k,v,L,0.1,block_n=bn,num_warps=nw,num_stages=ns),sets)
                rows.append(dict(Hq=Hq,D=D,N=N,B=B,v=f"v2 kv{bits} bn{bn} w{nw} s{ns}",us=t,GBps=nb/t/1e3,share=nb/t/1e3/copy))
            except Exception as e:
                rows.append(dict(Hq=Hq,D=D,N=N,B=B,v=f"v2 kv{bits} bn{bn} w{nw} s{ns}",error=str(e)[:100]))
        del sets,kv
        torch.cuda.empty_cache()
common.print_table(rows,["Hq","D","N","B","v","us","GBps","share","error"])
json.dump(rows,open(os.environ.get("OUT","/tmp")+"/ab_attention.json","w"),indent=1)
