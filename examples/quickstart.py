"""The README's first example, verbatim: tensorize a model, compile it with comera_fx's backend, train it with
RankAdaptive. About 15 s on 2 CPU cores, most of it Inductor compiling once: the hook sees the model is compiled
and rounds the cores in place at each prune point; on the CPU, at max rank 16, it also skips the physical shrink
at the last one, which would narrow no GEMM (on a GPU that shrink is the one recompile; ``hook.compact()`` stores
the live ranks on request). Run: .venv/bin/python examples/quickstart.py"""

# --- README example start
import torch, comera_fx

model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
print(comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=16)))  # both weights -> TT cores + rank gates
compiled = torch.compile(model, backend=comera_fx.backend)                   # comera_fx's passes, then Inductor
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
schedule = comera_fx.BudgetConfig(keep_fraction=0.5, total_steps=200, prunes=2)  # half the TT size by step 160
hook = comera_fx.RankAdaptive(model, optimizer, schedule)    # compiled: prunes round in place, ≤ 1 recompile at the end
teacher = comera_fx.TTLinear.from_dense(torch.nn.Linear(512, 512), max_rank=4, init="random")  # a task to learn
for step in range(200):                                                      # your loop, unchanged
    x = torch.randn(256, 512)
    loss = torch.nn.functional.mse_loss(compiled(x), teacher(x).detach())
    loss.backward(); optimizer.step(); optimizer.zero_grad()                 # the hook prunes inside step()
print(f"loss {loss.item():.4f}", hook.summary())                            # sizes and ranks, start and end
# --- README example end
