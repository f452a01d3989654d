#!/usr/bin/env python3
"""Generate a long-prompt request trace in Mooncake's JSONL format (tool/agent-like).

Why: the only real trace the project has (Mooncake's conversation trace) has short prompts
(12K tokens on average); the retention work must also hold where prompts are 10K-100K tokens
and share long prefixes, as in Mooncake's tool-and-agent traces. This writes such a trace,
deterministically from a seed, in the same format `v4pool simulate --trace` reads
(`src/sim/trace.rs`): one JSON object per line with `timestamp` (ms from the start),
`input_length`, `output_length` and `hash_ids`, the prefix hashes of the prompt's 512-token
blocks (equal ids at equal positions mean a shared prefix; the last block may be partial).

Shape: a few long system/tool prefixes (each session opens with one of them), sessions that
grow turn by turn (each turn re-sends the whole history: the previous prompt, the previous
answer and a new tool result or user message), optionally forking (an agent retrying from an
earlier turn), with Poisson session starts and think times between turns. The prompt is capped
at `--max-prompt`: a session ends when its next turn would pass it.

Content identity follows the trace's rule: a 512-token block's id names its content, so a
turn's full blocks that lie inside the previous prompt's full blocks keep their ids; the
previous prompt's partial last block, grown by the answer, gets a new id, as does every new
block.

Usage: scripts/gen_long_trace.py --seed 1 --shape agent > target/long_agent_s1.jsonl
"""

import argparse
import json
import random
import sys

BLOCK = 512

SHAPES = {
    # A handful of long tool prefixes, sessions of a few turns adding tool output.
    "agent": dict(
        prefixes=(4, 12_000, 32_000),
        turns=(3, 9),
        add=(1_000, 8_000),
        output=(100, 800),
        think_s=(2.0, 30.0),
        fork=0.15,
    ),
    # Fewer, longer prefixes; long sessions with bigger steps and frequent forks.
    "tools": dict(
        prefixes=(2, 30_000, 48_000),
        turns=(2, 6),
        add=(4_000, 16_000),
        output=(200, 1_500),
        think_s=(5.0, 60.0),
        fork=0.3,
    ),
    # Agent loops: long sessions of small steps (a tool call's result, a short answer) on
    # long prompts, so consecutive turns end a few blocks apart.
    "steps": dict(
        prefixes=(6, 10_000, 40_000),
        turns=(6, 30),
        add=(300, 3_000),
        output=(50, 400),
        think_s=(1.0, 10.0),
        fork=0.05,
    ),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="agent")
    ap.add_argument("--sessions", type=int, default=300, help="sessions (each several requests)")
    ap.add_argument("--rate", type=float, default=0.5, help="session starts per second")
    ap.add_argument("--prefixes", type=int, default=0, help="shared prefixes (0: the shape's)")
    ap.add_argument("--min-prompt", type=int, default=10_000)
    ap.add_argument("--max-prompt", type=int, default=100_000)
    a = ap.parse_args()
    if a.sessions <= 0 or a.prefixes < 0 or a.rate <= 0 or not 0 < a.min_prompt <= a.max_prompt:
        print("gen_long_trace: bad arguments", file=sys.stderr)
        return 2
    shape = SHAPES[a.shape]
    rng = random.Random(a.seed)
    next_id = 0

    def fresh(n: int) -> list:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    count, lo, hi = shape["prefixes"]
    if a.prefixes > 0:
        count = a.prefixes
    # Prefix lengths in whole blocks: a system/tool prompt is followed by the session's own
    # content, so its last block is full and shared.
    prefixes = [fresh(rng.randint(lo, hi) // BLOCK) for _ in range(count)]

    events = []  # (timestamp ms, input, output, ids)
    t = 0.0
    for _ in range(a.sessions):
        t += rng.expovariate(a.rate)
        pre = prefixes[rng.randrange(count)]
        # State of a session: its full-block ids and its length in tokens.
        full = list(pre)
        length = len(pre) * BLOCK
        history = []  # (full ids, length) after each turn, for forks
        clock = t
        turns = rng.randint(*shape["turns"])
        k = 0
        while k < turns:
            add = rng.randint(*shape["add"])
            prompt = length + add
            if prompt > a.max_prompt:
                break
            nfull = prompt // BLOCK
            ids = full[: min(len(full), nfull)]
            ids += fresh(nfull - len(ids))
            if prompt % BLOCK:
                ids += fresh(1)
            out = rng.randint(*shape["output"])
            if prompt >= a.min_prompt:
                events.append((int(clock * 1000), prompt, out, ids))
            # The next turn re-sends this prompt and its answer: the full blocks stay, the
            # partial one grows into new content.
            full = ids[:nfull]
            length = prompt + out
            history.append((list(full), length))
            clock += rng.uniform(*shape["think_s"])
            k += 1
            if len(history) > 1 and rng.random() < shape["fork"]:
                # An agent retries from an earlier turn: the history forks there.
                full, length = history[rng.randrange(len(history) - 1)]
                full = list(full)
    events.sort(key=lambda e: e[0])
    w = sys.stdout
    for ts, inp, out, ids in events:
        w.write(json.dumps({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids}))
        w.write("\n")
    print(f"gen_long_trace: {len(events)} requests, {next_id} ids", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
