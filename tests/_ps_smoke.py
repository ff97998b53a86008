import time, torch, torch.distributed as dist
import tensorpar as tp, tensorpar.parallel_state as ps
from tests.harness import run_on_ranks
def body():
    out=[]
    for order in ("tp-cp-ep-dp-pp","tp-cp-pp-ep-dp"):
        for (t,p,c,e) in [(2,4,1,1),(2,2,2,1),(1,8,1,1),(8,1,1,1),(2,1,1,4),(1,2,4,1),(2,2,1,2)]:
            t0=time.perf_counter()
            tp.initialize_model_parallel(t,p,context_parallel_size=c,expert_model_parallel_size=e,order=order)
            r=(dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
               dist.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True)), ps.get_expert_data_parallel_world_size(), len(ps.created_groups()))
            x=torch.ones(1); dist.all_reduce(x, group=ps.get_data_parallel_group()); 
            tp.destroy_model_parallel()
            out.append((order,t,p,c,e,round(time.perf_counter()-t0,3),r))
