"""Trainer side: AdamW on a small real model, every step published from
memory as the next weightcast version (bf16, what the rollout engines serve).

    python examples/python/trainer.py --bucket file:///tmp/wc-py/bucket --steps 20

Any store URL the CLI takes works (s3://, gs://, az://, hf://buckets/...).
Run examples/python/engine.py against the same bucket to follow it.
"""

import argparse
import logging
import time

import torch

import weightcast
from common import load_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bucket", default="file:///tmp/wc-py/bucket")
    ap.add_argument("--state-dir", default="/tmp/wc-py/trainer-state")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between steps")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    model, config = load_model()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    pub = weightcast.Publisher(a.bucket, state_dir=a.state_dir, anchor_every=10)
    files = {"config.json": config} if config else None
    g = torch.Generator().manual_seed(0)
    start = (pub.version + 1) if pub.version is not None else 0
    for step in range(start, start + a.steps):
        if step > start:
            ids = torch.randint(1000, 30000, (8, 32), generator=g)
            out = model(input_ids=ids).last_hidden_state
            loss = (out[:, 0] - out[:, 1:].mean(1)).pow(2).mean()  # a toy objective
            opt.zero_grad()
            loss.backward()
            opt.step()
        # the served weights: bf16 copies of the trainer's tensors, in memory
        served = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()
                  if v.is_floating_point()}
        report = pub.publish(served, files=files, step=step)
        print(f"step {step}: version {report['version']} {report['kind']} "
              f"{report['bytes']} bytes, {report['changed'] / report['total']:.2%} changed",
              flush=True)
        time.sleep(a.interval)


if __name__ == "__main__":
    main()
