"""DistributedDataParallel on gpuring's torch.distributed backend, on the CPU:

    torchrun --standalone --nproc-per-node 2 examples/torch_ddp.py [--steps 50] [--device cuda]

Code written for torch.distributed names the backend "gpuring" (after `import gpuring.torch`,
which registers it) where it named "gloo" or "nccl"; nothing else changes. torchrun sets each
process's RANK, WORLD_SIZE and MASTER_ADDR/MASTER_PORT (`env://`). Each rank trains the same
small model on its own batches; DDP averages the gradients with the backend's all_reduce, so
the parameters stay the same on every rank, which this checks at the end.
"""

import argparse
import os

import torch
import torch.distributed as dist

import gpuring.torch  # noqa: F401  (registers the "gpuring" backend)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))
                              % torch.cuda.device_count())
        torch.cuda.set_device(device)

    dist.init_process_group("gpuring")  # was: "gloo" or "nccl"
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 1)).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    target = torch.randn(16, 1, generator=torch.Generator().manual_seed(1)).to(device)
    batches = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for _ in range(args.steps):
        x = torch.randn(32, 16, generator=batches).to(device)
        loss = torch.nn.functional.mse_loss(ddp(x), torch.tanh(x @ target))
        optimizer.zero_grad()
        loss.backward()  # DDP all_reduces the gradients here, through gpuring
        optimizer.step()

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(flat, other) for other in everyone), "the ranks' weights differ"
    mean_loss = loss.detach().reshape(1)
    dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
    if rank == 0:
        print(f"{size} ranks, {args.steps} steps on {device.type}: loss {mean_loss.item():.4f}, "
              "the same weights on every rank")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
