# torchrun --nproc-per-node 2 examples/gpt_step.py
import torch
import tensorpar as tp

tp.initialize_model_parallel(tensor_model_parallel_size=2)   # NCCL on GPUs, gloo on CPU
tp.model_parallel_manual_seed(1234)                          # same weights as TP=1, sharded
config = tp.GPTConfig.preset("tiny", sequence_parallel=True)
model = tp.GPT(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

# The default stream is seeded alike on every rank, so every TP rank draws the same batch.
tokens = torch.randint(0, config.vocab_size, (4, 65), device=tp.parallel_state.default_device())
for step in range(3):
    loss = model(tokens[:, :-1], tokens[:, 1:])              # same loss on every TP rank
    loss.backward()
    tp.allreduce_sequence_parallel_grads(model)              # LayerNorm grads under SP
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if tp.get_tensor_model_parallel_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}")
tp.destroy_model_parallel()
