"""The Responses API's streaming overhead against chat completions on the same request: one
streamed request at a time to a running server, alternating the two endpoints, the same
messages, the same number of output tokens (``ignore_eos``).

For each request: the seconds to the first token and to the end, and the mean gap between
output deltas. The table compares the medians; the overhead is the Responses median end-to-end
time over the chat one, minus one (issue target: at most 5%).

    python -m benchmarks.responses_overhead --base-url http://localhost:8011 --out X.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import httpx

PROMPT = "Write a long story about a lighthouse keeper who collects maps. " * 16


def is_text_delta(event: dict[str, Any]) -> bool:
    """A chat chunk with text, or a Responses ``response.output_text.delta`` event."""
    if event.get("type") == "response.output_text.delta":
        return bool(event["delta"])
    choices = event.get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content"))


def timed_stream(client: httpx.Client, path: str, body: dict[str, Any]) -> dict:
    """One streamed request: seconds to the first text delta and to the stream's end, and the
    number of text deltas and the mean gap between them."""
    sent = time.perf_counter()
    stamps = []
    with client.stream("POST", path, json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            data = line.removeprefix("data:").strip()
            if line.startswith("data:") and data != "[DONE]" and is_text_delta(json.loads(data)):
                stamps.append(time.perf_counter())
    end = time.perf_counter()
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {
        "ttft_s": stamps[0] - sent if stamps else None,
        "e2e_s": end - sent,
        "deltas": len(stamps),
        "mean_gap_ms": 1e3 * statistics.fmean(gaps) if gaps else None,
    }


def bodies(model: str, max_tokens: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """The same request through each endpoint: (path, body)."""
    common = {"model": model, "stream": True, "temperature": 0.0, "ignore_eos": True}
    chat = {
        **common,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_completion_tokens": max_tokens,
    }
    responses = {**common, "input": PROMPT, "max_output_tokens": max_tokens, "store": False}
    return {
        "chat": ("/v1/chat/completions", chat),
        "responses": ("/v1/responses", responses),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://localhost:8011")
    parser.add_argument("--requests", type=int, default=12, help="per endpoint")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", default="responses_overhead.json")
    args = parser.parse_args()
    client = httpx.Client(base_url=args.base_url)
    model = client.get("/v1/models").json()["data"][0]["id"]
    cases = bodies(model, args.max_tokens)
    for path, body in cases.values():  # warm both paths up
        timed_stream(client, path, body)
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    for _ in range(args.requests):
        for name, (path, body) in cases.items():
            runs[name].append(timed_stream(client, path, body))
    summary = {
        name: {
            key: statistics.median(r[key] for r in rows if r[key] is not None)
            for key in ("ttft_s", "e2e_s", "deltas", "mean_gap_ms")
        }
        for name, rows in runs.items()
    }
    overhead = summary["responses"]["e2e_s"] / summary["chat"]["e2e_s"] - 1
    with open(args.out, "w") as f:
        json.dump({"runs": runs, "median": summary, "overhead": overhead}, f, indent=1)
    print(f"{'endpoint':<10} | {'TTFT ms':>8} | {'e2e s':>7} | {'deltas':>6} | {'gap ms':>7}")
    for name, row in summary.items():
        print(
            f"{name:<10} | {1e3 * row['ttft_s']:8.1f} | {row['e2e_s']:7.3f} | "
            f"{row['deltas']:6.0f} | {row['mean_gap_ms']:7.2f}"
        )
    print(f"Responses streaming overhead: {100 * overhead:+.1f}% end to end (target <= 5%)")


if __name__ == "__main__":
    main()
