"""Hostile input at full scale against a running ``jaxserve launch``: the seven findings of
"hostile input, round two" and findings 6 and 8-10 of round three (schemas, tool parameters and
tool-call arguments; integer bounds past 64 bits; the llama3_json parser; operator input), each
sent as the attacker sent it, while a neighbour's ordinary request is timed.

For every case it records what the hostile request got (status, seconds, response bytes), the
neighbour's latency and ``/health``'s while it ran (against the same measured idle), and that the
server still answers afterwards. With ``--pid`` it counts the server's memory maps (a compile
storm adds about 87 per sampler variant); with ``--server-log`` of a server started with
``JAX_LOG_COMPILES=1`` it counts programs compiled while the attack ran (should be none), and
the tracebacks logged (each 500 is one). Round three's finding 9 runs the parser in this
process, and finding 10 starts ``jaxserve launch`` itself (a malformed config.json, a
``--max-model-len`` past the model): neither needs the server.

    python -m benchmarks.hostile_full --base-url http://localhost:8011 --pid PID \
        --server-log launch.log --output-json hostile.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

NEIGHBOUR_PROMPT = list(range(1000, 1100))  # 100 prompt tokens, 16 generated
ID_RANGE = (100, 4000)  # token ids the attacks draw from: inside any vocabulary of 4,096+


class Probe:
    """The neighbour: an ordinary 16-token completion and a /health call, timed in a loop."""

    def __init__(self, client: httpx.Client, model: str) -> None:
        self.client, self.model = client, model

    def completion_s(self) -> float:
        body = {"model": self.model, "prompt": NEIGHBOUR_PROMPT, "max_tokens": 16}
        t0 = time.perf_counter()
        r = self.client.post("/v1/completions", json=body | {"temperature": 0})
        assert r.status_code == 200, r.text[:300]
        return time.perf_counter() - t0

    def health_s(self) -> float:
        t0 = time.perf_counter()
        assert self.client.get("/health").status_code == 200
        return time.perf_counter() - t0

    def idle(self, rounds: int = 5) -> dict[str, float]:
        self.completion_s()
        return {
            "completion_s": statistics.median(self.completion_s() for _ in range(rounds)),
            "health_s": statistics.median(self.health_s() for _ in range(rounds)),
        }

    def during(self, attack: Callable[[], Any]) -> dict[str, Any]:
        """Runs ``attack`` in a thread and probes until it returns (at least one probe)."""
        done = threading.Event()
        result: dict[str, Any] = {}

        def run() -> None:
            t0 = time.perf_counter()
            try:
                result["attack"] = attack()
            except Exception as e:  # recorded, not raised: the report says what happened
                result["attack"] = {"error": repr(e)[:300]}
            result["attack_s"] = round(time.perf_counter() - t0, 2)
            done.set()

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(0.2)  # let the attack reach the server first
        completions, health = [], []
        while True:
            health.append(self.health_s())
            completions.append(self.completion_s())
            if done.is_set():
                break
        thread.join()
        return result | {
            "neighbour_max_s": round(max(completions), 3),
            "neighbour_median_s": round(statistics.median(completions), 3),
            "health_max_s": round(max(health), 3),
            "num_probes": len(completions),
        }


def post(client: httpx.Client, path: str, body: Any, raw: bytes | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    if raw is not None:
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    out: dict[str, Any] = {
        "status": r.status_code,
        "seconds": round(time.perf_counter() - t0, 3),
        "bytes": len(r.content),
    }
    if r.status_code != 200:
        try:
            error = r.json()["error"]
            out["param"], out["message"] = error.get("param"), error["message"][:160]
        except (ValueError, KeyError, TypeError):
            out["body"] = r.text[:160]
    return out


def stream(client: httpx.Client, path: str, body: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    with client.stream("POST", path, json=body | {"stream": True}) as r:
        text = r.read().decode(errors="replace")
    return {
        "status": r.status_code,
        "seconds": round(time.perf_counter() - t0, 3),
        "tail": text[-160:],
    }


def finding_1(client: httpx.Client, model: str) -> list[dict[str, Any]]:
    cases = []
    for top_k in (2**31, 2**63, 10**30):
        for path, body in (
            ("/v1/completions", {"prompt": NEIGHBOUR_PROMPT}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "<t5> <t6>"}]}),
        ):
            body = body | {"model": model, "top_k": top_k, "max_tokens": 8}
            for is_stream in (False, True):
                result = stream(client, path, body) if is_stream else post(client, path, body)
                cases.append({"top_k": str(top_k), "path": path, "stream": is_stream} | result)
    return cases


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} "a"\n' for i in range(n)) + f'r{n}: "b"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} "a"\n' for i in range(n)) + f'r{n} ::= "b"'


def ref_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer", "minimum": 0, "maximum": 9}
    return {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "required": ["x"],
            "$defs": defs}  # fmt: skip


def deep_grammars(client: httpx.Client, model: str) -> dict[str, Any]:
    """Round three, finding 1: a 3,000-level chain through every entry point (each killed the
    server with a stack overflow). A forced tool choice's chain is left to the tests
    (tests/test_hostile_grammars.py): a chat template that renders the tools makes its 100 KB
    of parameters a prompt longer than the model's context, refused before any compile."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    text = {"model": model, "prompt": "hi", "max_tokens": 8}
    schema = {"type": "json_schema", "json_schema": {"name": "deep", "schema": ref_chain(3000)}}
    cases = {
        "lark": ("/v1/completions", text | {"structured_outputs": {"grammar": lark_chain(3000)}}),
        "gbnf": ("/v1/completions", text | {"guided_grammar": gbnf_chain(3000)}),
        "json": ("/v1/completions", text | {"structured_outputs": {"json": ref_chain(3000)}}),
        "response_format": ("/v1/chat/completions", chat | {"response_format": schema}),
    }
    return {name: post(client, path, body) for name, (path, body) in cases.items()}


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS"))
    return round(int(line.split()[1]) / 1024, 1)


def many(n: int, fn: Callable[[], dict[str, Any]]) -> list[dict[str, Any]]:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: fn(), range(n)))


def random_params(rng: random.Random) -> dict[str, Any]:
    """One valid-range combination of the sampler's parameters and a prompt length."""
    body: dict[str, Any] = {
        "prompt": [rng.randrange(*ID_RANGE) for _ in range(rng.choice((1, 7, 60, 300, 900)))],
        "max_tokens": rng.choice((1, 4, 16)),
        "n": rng.choice((1, 1, 2, 5)),
        "temperature": rng.choice((0.0, 0.3, 1.0, 2.0)),
        "top_p": rng.choice((1.0, 0.9, 0.01)),
        "top_k": rng.choice((-1, 1, 5, 50, 1000)),
        "min_p": rng.choice((0.0, 0.05)),
        "presence_penalty": rng.choice((0.0, 0.5, -1.0)),
        "frequency_penalty": rng.choice((0.0, 1.5)),
        "repetition_penalty": rng.choice((1.0, 1.3, 0.8)),
        "seed": rng.choice((None, rng.randrange(2**32))),
        "min_tokens": rng.choice((0, 1)),
    }
    if rng.random() < 0.3:
        body["logprobs"] = rng.choice((0, 1, 5, 20))
    if rng.random() < 0.2:
        body["echo"] = True
        body["max_tokens"] = max(body["max_tokens"], 1)
    if rng.random() < 0.2:
        body["logit_bias"] = {str(rng.randrange(*ID_RANGE)): rng.uniform(-100, 100)}
    if rng.random() < 0.1:
        body["stop_token_ids"] = [rng.randrange(*ID_RANGE) for _ in range(rng.choice((1, 500)))]
    return {k: v for k, v in body.items() if v is not None}


def nested(depth: int, leaf: Any = None) -> Any:
    """An object schema with ``depth`` objects nested in one another."""
    schema = leaf if leaf is not None else {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def round_three_6(client: httpx.Client, model: str) -> dict[str, Any]:
    """Finding 6: each answered 500 (and was logged twice); each must be a 400 naming the
    field, and the schema true a 200."""
    completion: dict[str, Any] = {"model": model, "prompt": NEIGHBOUR_PROMPT, "max_tokens": 8}
    user = {"role": "user", "content": "hi"}
    chat: dict[str, Any] = {"model": model, "messages": [user], "max_tokens": 8}
    draft = "http://json-schema.org/draft-0{}/schema#"

    def tool(parameters: dict[str, Any]) -> dict[str, Any]:
        return {"type": "function", "function": {"name": "f", "parameters": parameters}}

    deep_call = {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000},
            }
        ],
    }
    cases: dict[str, tuple[str, dict[str, Any]]] = {
        "structured_outputs_json_true": (
            "/v1/completions",
            completion | {"structured_outputs": {"json": True}},
        ),
        "structured_outputs_json_false": (
            "/v1/completions",
            completion | {"structured_outputs": {"json": False}},
        ),
        "guided_json_text_false": ("/v1/completions", completion | {"guided_json": "false"}),
        "response_format_200_deep": (
            "/v1/chat/completions",
            chat
            | {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": nested(100)},
                }
            },
        ),
        "guided_json_text_5000_deep": (
            "/v1/completions",
            completion | {"guided_json": "[" * 5000 + "]" * 5000},
        ),
        "tool_defs_draft_03": (
            "/v1/chat/completions",
            chat
            | {
                "tools": [tool({"$schema": draft.format(3), "type": "object", "$defs": [1]})],
                "tool_choice": "required",
            },
        ),
        "tool_definitions_draft_04": (
            "/v1/chat/completions",
            chat
            | {
                "tools": [tool({"$schema": draft.format(4), "type": "object", "definitions": 5})],
                "tool_choice": "required",
            },
        ),
        "tool_parameters_300_deep": (
            "/v1/chat/completions",
            chat | {"tools": [tool(nested(150))], "tool_choice": "required"},
        ),
        "tool_call_arguments_100000_deep": (
            "/v1/chat/completions",
            chat | {"messages": [user, deep_call, user]},
        ),
    }
    return {
        name: post(client, path, None, raw=json.dumps(body).encode())
        for name, (path, body) in cases.items()
    }


def round_three_8(client: httpx.Client, model: str) -> dict[str, Any]:
    """Finding 8: integer bounds past 64 bits. Those that admit only integers past ±(2**53 - 1)
    must be a 400 (min 1e30 and max 1e31 made every output 2**63 - 1; min -1e30 and max -1e29
    crashed the server); those that only exclude them must generate integers inside them."""
    results: dict[str, Any] = {}
    bounds_cases: dict[str, dict[str, float]] = {
        "minimum_1e30": {"minimum": 1e30},
        "minimum_1e30_maximum_1e31": {"minimum": 1e30, "maximum": 1e31},
        "minimum_-1e30_maximum_-1e29": {"minimum": -1e30, "maximum": -1e29},
        "maximum_1e30": {"maximum": 1e30},
        "minimum_-1e30": {"minimum": -1e30},
        "maximum_2**63-2": {"maximum": 2**63 - 2},
    }
    for name, bounds in bounds_cases.items():
        body = {
            "model": model,
            "prompt": NEIGHBOUR_PROMPT,
            "max_tokens": 24,
            "temperature": 1.0,
            "seed": 0,
            "guided_json": {"type": "integer", **bounds},
        }
        result = post(client, "/v1/completions", body)
        if result["status"] == 200:
            choice = client.post("/v1/completions", json=body).json()["choices"][0]
            result["text"] = choice["text"]
            if choice["finish_reason"] == "stop":
                value = int(choice["text"])
                result["in_bounds"] = (
                    bounds.get("minimum", value) <= value <= bounds.get("maximum", value)
                )
        results[name] = result
    return results


def round_three_9() -> dict[str, Any]:
    """Finding 9, in this process: the llama3_json parser's message for text after
    <|python_tag|>, whole and a character at a time (they differed)."""
    from jaxserve.server.chat.tool_calls import MessageDelta
    from jaxserve.server.chat.tool_parsers import make_tool_parser

    def parse(pieces: list[str]) -> tuple[str, int]:
        parser = make_tool_parser("llama3_json", parallel=True)
        message = MessageDelta()
        for piece in pieces:
            message.extend(parser.feed(piece))
        message.extend(parser.finish())
        return message.content, len(message.tool_calls)

    texts = ["<|python_tag|> It is sunny.", '<|python_tag|>\n {"name": "f", "parameters": {}}']
    return {
        text: {"whole": parse([text]), "streamed": parse(list(text))}
        | {"same": parse([text]) == parse(list(text))}
        for text in texts
    }


def round_three_10() -> dict[str, Any]:
    """Finding 10, by starting ``jaxserve launch``: a config.json whose rope factor is "abc"
    and a --max-model-len of 131072 on the demo model (1,024 positions). Each must exit
    non-zero with one line naming the field, or both lengths, and no traceback."""
    from jaxserve.engine_config import default_model_dir

    def launch(*argv: str) -> dict[str, Any]:
        command = [sys.executable, "-c", "from jaxserve.cli import main; raise SystemExit(main())"]
        t0 = time.perf_counter()
        try:
            done = subprocess.run(
                # a small memory share: the attacked server holds the rest of a GPU
                [
                    *command,
                    "launch",
                    *argv,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--gpu-memory-utilization",
                    "0.05",
                ],  # fmt: skip
                capture_output=True,
                text=True,
                timeout=120,
            )
        except subprocess.TimeoutExpired:
            return {"exit": "still running after 120 s (it started)"}
        errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
        return {
            "exit": done.returncode,
            "seconds": round(time.perf_counter() - t0, 1),
            "error": errors[-1][-240:] if errors else None,
            "traceback": "Traceback" in done.stderr,
        }

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        shutil.copytree(default_model_dir(), model)
        config = json.loads((model / "config.json").read_text())
        config["rope_parameters"] = {"rope_type": "linear", "factor": "abc", "rope_theta": 1e4}
        (model / "config.json").write_text(json.dumps(config))
        return {
            "rope_factor_abc": launch(str(model)),
            "max_model_len_131072": launch("--max-model-len", "131072"),
        }


def map_count(pid: int | None) -> int | None:
    if pid is None:
        return None
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for _ in f)


def compile_count(log: Path | None) -> int | None:
    if log is None:
        return None
    text = log.read_text(errors="replace")
    return text.count("Finished XLA compilation") + text.count("Compiling ")


def traceback_count(log: Path | None) -> int | None:
    if log is None:
        return None
    return log.read_text(errors="replace").count("Traceback (most recent call last)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://localhost:8011")
    parser.add_argument("--api-key")
    parser.add_argument("--pid", type=int, help="the server's process id (memory maps)")
    parser.add_argument("--server-log", type=Path, help="its log, with JAX_LOG_COMPILES=1")
    parser.add_argument("--num-fuzz", type=int, default=400)
    parser.add_argument("--only", help="comma-separated case prefixes to run (default: all)")
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = httpx.Client(base_url=args.base_url, headers=headers, timeout=600)
    model = client.get("/v1/models").json()["data"][0]["id"]
    probe = Probe(client, model)
    report: dict[str, Any] = {"idle": probe.idle()}
    long_prompt = [random.Random(0).randrange(*ID_RANGE) for _ in range(1000)]

    def step(name: str, attack: Callable[[], Any]) -> None:
        if args.only and not name.startswith(tuple(args.only.split(","))):
            return
        before = map_count(args.pid), compile_count(args.server_log)
        tracebacks = traceback_count(args.server_log)
        report[name] = probe.during(attack)
        after = map_count(args.pid), compile_count(args.server_log)
        if args.pid:
            report[name]["maps_added"] = after[0] - before[0]  # type: ignore[operator]
        if args.server_log:
            report[name]["compiles"] = after[1] - before[1]  # type: ignore[operator]
            added = traceback_count(args.server_log) - tracebacks  # type: ignore[operator]
            report[name]["tracebacks"] = added
        report[name]["healthy_after"] = client.get("/health").status_code == 200
        print(name, json.dumps({k: v for k, v in report[name].items() if k != "attack"}))

    step("1_top_k_past_int32", lambda: finding_1(client, model))
    step(
        "2a_256_prompts_n_128",
        lambda: post(
            client,
            "/v1/completions",
            {"model": model, "prompt": [[7, 8, 9]] * 256, "n": 128, "max_tokens": 8},
        ),
    )
    step(
        "2b_largest_allowed_request",  # 2 prompts x n=128: 256 sequences x 512 tokens
        lambda: post(
            client,
            "/v1/completions",
            {
                "model": model,
                "prompt": [long_prompt[:200], long_prompt[200:400]],
                "n": 128,
                "max_tokens": 512,
                "ignore_eos": True,
                "temperature": 1.0,
            },
        ),
    )
    amplify = {"model": model, "echo": True, "logprobs": 20, "n": 128, "max_tokens": 1}
    step(
        "3a_echo_logprobs_n_128_1000_tokens",
        lambda: post(client, "/v1/completions", amplify | {"prompt": long_prompt}),
    )
    step(
        "3b_same_8_prompts",
        lambda: post(client, "/v1/completions", amplify | {"prompt": [long_prompt] * 8}),
    )
    step(
        "3c_largest_allowed_echo_logprobs",  # one 1,000-token prompt, logprobs 20, n=1
        lambda: post(client, "/v1/completions", amplify | {"prompt": long_prompt, "n": 1}),
    )
    # Two-digit ids: 600,000 of them make a 1.8 MB body, under the 2 MiB body limit.
    detok_ids = [random.Random(1).randrange(10, 100) for _ in range(600_000)]
    step(
        "4a_8_detokenize_600k_ids",
        lambda: many(8, lambda: post(client, "/detokenize", {"model": model, "tokens": detok_ids})),
    )
    stop_body = {"model": model, "prompt": NEIGHBOUR_PROMPT, "n": 32, "max_tokens": 64}
    step(
        "4b_stop_token_ids_600k_n_32",
        lambda: post(client, "/v1/completions", stop_body | {"stop_token_ids": detok_ids}),
    )
    step(
        "4c_stop_token_ids_1024_n_32",  # the most a request may send
        lambda: post(
            client,
            "/v1/completions",
            stop_body | {"stop_token_ids": list(range(2000, 3024)), "ignore_eos": True},
        ),
    )
    rng = random.Random(5)
    combos = [random_params(rng) | {"model": model} for _ in range(args.num_fuzz)]

    def fuzz(bodies: list[dict[str, Any]]) -> dict[str, Any]:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda b: post(client, "/v1/completions", b), bodies))
        seconds = sorted(r["seconds"] for r in results)
        statuses: dict[str, int] = {}
        for r in results:
            statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
        return {
            "statuses": statuses,
            "p50_s": seconds[len(seconds) // 2],
            "max_s": seconds[-1],
            "errors": [r for r in results if r["status"] != 200][:5],
        }

    step("5a_fuzz_first_use", lambda: fuzz(combos))
    # The same parameters again with new prompt tokens (the prefix cache would serve the old).
    fresh = [c | {"prompt": [rng.randrange(*ID_RANGE) for _ in c["prompt"]]} for c in combos]
    step("5b_fuzz_repeat", lambda: fuzz(fresh))
    digits = "9" * 5000
    raw_cases = {
        "max_tokens": f'{{"model": "{model}", "prompt": [1, 2], "max_tokens": {digits}}}',
        "metadata": f'{{"model": "{model}", "prompt": [1, 2], "metadata": {{"a": {digits}}}}}',
        "logit_bias_superscript": json.dumps(
            {"model": model, "prompt": [1, 2], "logit_bias": {"\u00b2": 1}}
        ),
        "logit_bias_long_key": json.dumps(
            {"model": model, "prompt": [1, 2], "logit_bias": {digits: 1}}
        ),
    }
    step(
        "6_unreadable_numbers",
        lambda: {
            name: post(client, "/v1/completions", None, raw=body.encode())
            for name, body in raw_cases.items()
        },
    )

    def tiny_top_p() -> dict[str, Any]:
        base = {"model": model, "prompt": NEIGHBOUR_PROMPT, "max_tokens": 16}
        greedy = client.post("/v1/completions", json=base | {"temperature": 0}).json()
        texts = [
            client.post(
                "/v1/completions", json=base | {"top_p": 1e-300, "seed": seed, "temperature": 1}
            ).json()["choices"][0]["text"]
            for seed in range(6)
        ]
        return {
            "distinct_texts": len(set(texts)),
            "all_equal_greedy": all(t == greedy["choices"][0]["text"] for t in texts),
        }

    step("7_top_p_1e-300", tiny_top_p)
    step("r3_6_schemas_tools_arguments", lambda: round_three_6(client, model))
    step("r3_8_integer_bounds_past_64_bits", lambda: round_three_8(client, model))
    step("r3_9_llama3_python_tag_whitespace", round_three_9)
    step("r3_10_operator_input", round_three_10)

    # -- round three: grammars, schemas and tools -----------------------------------------
    text = {"model": model, "prompt": "hi", "max_tokens": 4}
    step("g1_deep_chains_every_entry_point", lambda: deep_grammars(client, model))

    def cache_in_bytes() -> dict[str, Any]:
        before = rss_mb(args.pid)
        regexes = [post(client, "/v1/completions", text | {"guided_regex": f"a{{{1000000 + i}}}"})
                   for i in range(25)]  # fmt: skip
        choices = [post(client, "/v1/completions", text | {"guided_choice": [c * 200_000]})
                   for c in "abcdefghijklmnopqrst"]  # fmt: skip
        return {
            "rss_mb_before": before,
            "rss_mb_after": rss_mb(args.pid),
            "regex_statuses": sorted({r["status"] for r in regexes}),
            "choice_statuses": sorted({r["status"] for r in choices}),
        }

    step("g2_25_huge_regexes_20_huge_choices", cache_in_bytes)

    def timeout_then_json_object() -> dict[str, Any]:
        slow = post(client, "/v1/completions", text | {"guided_grammar": gbnf_chain(4000)})
        again = post(client, "/v1/completions", text | {"guided_grammar": gbnf_chain(4000)})
        plain = post(client, "/v1/completions", text | {"response_format": {"type": "json_object"}})
        return {"slow": slow, "slow_again": again, "json_object_after": plain}

    step("g3_timeout_not_cached", timeout_then_json_object)

    def slow_grammars_and_a_neighbour_schema() -> dict[str, Any]:
        # The neighbour connects from 127.0.0.2: another client than the attacker's 127.0.0.1.
        transport = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(
            base_url=args.base_url, headers=headers, timeout=600, transport=transport
        ) as other:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                slow = [
                    pool.submit(post, client, "/v1/completions",
                                text | {"guided_grammar": gbnf_chain(4000 + i)})
                    for i in range(4)
                ]  # fmt: skip
                time.sleep(0.5)
                schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
                neighbour = post(other, "/v1/completions", text | {"guided_json": schema})
                big = json.dumps(text) + " " * 20_000  # parsed on the host-work thread
                large = post(other, "/v1/completions", None, raw=big.encode())
                return {
                    "neighbour_schema": neighbour,
                    "neighbour_large_body": large,
                    "attacker": [f.result() for f in slow],
                }

    step("g4_slow_grammars_beside_a_neighbour", slow_grammars_and_a_neighbour_schema)
    unfollowable = {
        "a{1000000}": {"guided_regex": "a{1000000}"},
        "(a{1000}){1000}": {"guided_regex": "(a{1000}){1000}"},
        "20000_way_rule": {
            "guided_grammar": "start: " + " | ".join(f'"w{i}"' for i in range(20_000))
        },
    }
    step(
        "g7_grammars_that_cannot_be_followed",
        lambda: {
            name: post(client, "/v1/completions", text | body)
            for name, body in unfollowable.items()
        },
    )
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=1))
    idle = report["idle"]
    print(
        f"\nidle neighbour {idle['completion_s'] * 1e3:.0f} ms, "
        f"/health {idle['health_s'] * 1e3:.1f} ms"
    )
    print(
        f"{'case':38} {'attack s':>8} {'neigh med':>9} {'neigh max':>9} "
        f"{'health max':>10} {'maps+':>5} {'comp':>4} ok"
    )
    for name, r in report.items():
        if name == "idle":
            continue
        print(
            f"{name:38} {r['attack_s']:8.2f} {r['neighbour_median_s']:9.3f} "
            f"{r['neighbour_max_s']:9.3f} {r['health_max_s']:10.3f} "
            f"{r.get('maps_added', '-')!s:>5} {r.get('compiles', '-')!s:>4} {r['healthy_after']}"
        )


if __name__ == "__main__":
    main()
