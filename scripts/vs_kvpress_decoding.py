"""The kvpress side of the periodic re-compression comparison (docs/results/frontier.md). Runs in the kvpress
environment (scripts/vs_kvpress_env.sh); never imports kvcompress.

    /work/kvpress-venv/bin/python scripts/vs_kvpress_decoding.py runs/frontier/samples.json \
        runs/frontier/kvpress-decoding.jsonl --prompt 512 --steps 128 --interval 32 --target 256

For every sample: the first ``--prompt`` context tokens are prefilled under ``DecodingPress(KeyDiffPress(),
compression_interval, target_size)`` (which leaves the prompt whole), then the next ``--steps`` context tokens are
fed one forward each (teacher-forced, so both sides see the same ids), with their true positions as kvpress's
pipeline passes them. Each new key is recorded as it enters the cache (a hook that runs before the press's), and
the final cache's keys are matched to them: the kept token indices of every layer and KV head, one JSON row.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("samples", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--interval", type=int, default=32)
    parser.add_argument("--target", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    spec = json.loads(args.samples.read_text())
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    env = {"kvpress": "0.5.5", "transformers": transformers.__version__, "torch": torch.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as handle, torch.no_grad():
        for sample in spec["samples"]:
            ids = torch.tensor([sample["context_ids"][: args.prompt + args.steps]])
            cache = DynamicCache()
            seen: list[list[torch.Tensor]] = [[] for _ in model.model.layers]  # per layer: [H, d] key per token

            def record(module, _args, _kwargs, _output, index=None, cache=cache, seen=seen):
                keys = cache.layers[index].keys[0]  # [H, n, d], the new keys last (the press has not run yet)
                fresh = keys.shape[1] if not seen[index] else 1
                seen[index].extend(keys[:, keys.shape[1] - fresh + i] for i in range(fresh))

            hooks = [
                layer.self_attn.register_forward_hook(lambda *a, i=i: record(*a, index=i), with_kwargs=True)
                for i, layer in enumerate(model.model.layers)
            ]
            press = kvpress.DecodingPress(
                base_press=kvpress.KeyDiffPress(), compression_interval=args.interval, target_size=args.target
            )
            with press(model):
                model.model(input_ids=ids[:, : args.prompt], past_key_values=cache)
                for step in range(args.prompt, args.prompt + args.steps):
                    positions = torch.tensor([[step]])
                    model.model(input_ids=ids[:, step : step + 1], past_key_values=cache, position_ids=positions)
            for hook in hooks:
                hook.remove()
            kept = []
            for index, layer in enumerate(cache.layers):
                table = torch.stack(seen[index], dim=1)  # [H, tokens, d]
                match = (layer.keys[0][:, :, None, :] == table[:, None, :, :]).all(-1)  # [H, n, tokens]
                if not bool(match.any(-1).all()):
                    raise RuntimeError(f"layer {index}: a kept key matches no recorded key")
                kept.append([sorted(row.tolist()) for row in match.float().argmax(-1)])
            row = {"sample": sample["id"], "press": "DecodingPress(KeyDiffPress)", "prompt": args.prompt}
            row |= {"steps": args.steps, "interval": args.interval, "target": args.target, "kept": kept, "env": env}
            handle.write(json.dumps(row) + "\n")
            handle.flush()
            print(f"{sample['id']}: {len(kept[0][0])} kept per head in layer 0", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
