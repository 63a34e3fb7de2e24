"""Engine side: a model whose tensors are patched in place by each version
the trainer publishes (verified before anything is written), serving
between updates.

    python examples/python/engine.py --bucket file:///tmp/wc-py/bucket

Starts from whatever the bucket holds (an anchor update), then applies each
delta in place; stops after --idle seconds without a new version. At the end
it checks every tensor against the version's digests (a full pass).
"""

import argparse
import logging

import torch

import weightcast
import weightcast.engine
from common import load_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bucket", default="file:///tmp/wc-py/bucket")
    ap.add_argument("--idle", type=float, default=10.0)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    model, _ = load_model()
    model = model.to(torch.bfloat16).eval()  # the engine serves bf16
    params = {k: v for k, v in weightcast.engine.state_dict_of(model).items()
              if v.is_floating_point()}
    follower = weightcast.engine.Follower(a.bucket, params=params, poll_interval=0.2)
    ids = torch.randint(1000, 30000, (1, 16), generator=torch.Generator().manual_seed(1))
    while True:
        report = follower.step(timeout=a.idle)
        if report is None:
            break
        with torch.no_grad():  # "serving": one forward pass with the new weights
            probe = model(input_ids=ids).last_hidden_state[0, 0, :3].float().tolist()
        print(f"version {report['version']} ({report['kind']}): {report['changed']} changed, "
              f"paused {report['pause_seconds'] * 1e3:.1f} ms; probe {probe}", flush=True)
    checked = follower.subscriber.verify(params)
    print(f"no new version for {a.idle} s; holding version {follower.version}, "
          f"{checked['checked']} tensors verified")


if __name__ == "__main__":
    main()
