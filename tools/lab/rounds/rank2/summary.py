"""The round's short table: every point of the rank and slice step benches (tools/lab/rounds/rank2)."""
import json
import sys
from pathlib import Path


def rows(path: str):
    if not Path(path).exists():
        print(f"{path}: missing")
        return
    result = json.loads(Path(path).read_text())
    for row in result["rows"]:
        yield result["target"], result["layers"], row


def main(paths: list[str]) -> None:
    print("| target | layers | setting | B | context | T | graph ms | floor ms | floor / ms | ms / floor | launches / layer | fallbacks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        for target, layers, row in rows(path):
            if "error" in row:
                print(f"| {target} | {layers} | {row.get('setting', '')} | {row['batch']} | {row['context']} | {row['T']} | "
                      f"error: {row['error'][:80]} |||||")
                continue
            fallbacks = sum(row.get("fallbacks", {}).values())
            print(f"| {target} | {layers} | {row.get('setting', '')} | {row['batch']} | {row['context']} | {row['T']} | "
                  f"{row['ms']:.2f} | "
                  f"{row['floor_ms']:.2f} | {100 * row['floor_fraction']:.0f}% | {1 / row['floor_fraction']:.2f}x | "
                  f"{row['kernels_per_layer']:.1f} | {fallbacks} |")


if __name__ == "__main__":
    main(sys.argv[1:])
