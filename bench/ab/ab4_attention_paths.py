"""A/B round 4: CUDA-core vs tensor-core quantized decode attention."""
import itertools, json, os, torch
from qfuse.bench import common
from qfuse.bench.attention import _make_kv, _nbytes
from qfuse.kernels.decode_attention import decode_attention_quantized_kv as attn
OUT=os.environ.get("OUT","/tmp")
copy=common.copy_bandwidth_gbs(); print("copy", copy, flush=True)
rows=[]
for (Hq,Hkv,D),N,B in [((16,8,256),131072,1),((16,8,256),8192,1),((32,8,128),131072,1),((32,8,128),8192,1),((16,8,256),32768,8)]:
    q=torch.randn(B,Hq,D,device="cuda",dtype=torch.bfloat16); L=torch.full((B,),N,dtype=torch.int32,device="cuda")
    for kind in ("kv4","kv8"):
        kv=_make_kv(kind,B,Hkv,N,D); nb=sum(_nbytes(t) for t in kv)
        sets=[kv]+[_make_kv(kind,B,Hkv,N,D) for _ in range(common.n_rotations(nb,cap=64)-1)]
        cfgs=[("tensor_cores",None,None)]+[("cuda_cores",bn,ns) for bn,ns in itertools.product((4,8,16,32),(2,3,4))]
        for path,bn,ns in cfgs:
            try:
                t=common.time_graph_us(lambda k,v: attn(q,k,v,L,0.1,_path=path,_block_n=bn,_num_stages=ns),sets)
                rows.append(dict(D=D,N=N,B=B,kind=kind,cfg=f"{path} bn{bn} s{ns}",us=t,share=nb/t/1e3/copy))
            except Exception as e:
                rows.append(dict(D=D,N=N,B=B,kind=kind,cfg=f"{path} bn{bn} s{ns}",error=str(e)[:80]))
        best=sorted((r for r in rows if (r["D"],r["N"],r["B"],r["kind"])==(D,N,B,kind) and "us" in r),key=lambda r:r["us"])
        tc=[r for r in rows if (r["D"],r["N"],r["B"],r["kind"])==(D,N,B,kind) and r["cfg"].startswith("tensor")]
        print("BEST", best[:2], "TC", tc, flush=True)
        del sets,kv; torch.cuda.empty_cache()
json.dump(rows,open(OUT+"/ab4.json","w"),indent=1)
