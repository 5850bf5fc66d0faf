"""The reference scheduler's test harness: a deterministic "model" (the next token a function of
every token before it), a fake worker that keeps its own state as docs/protocol.md's execute_model
says and checks every step it is sent, and the drivers the scheduler tests share."""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass, field

from sidecar.scheduler import Request, Scheduler, run

VOCAB = 23  # small, so generated tokens repeat and eos/stop tokens come up


# -- a deterministic "model": the next token is a function of every token before it -------------

def fold(digest: int, token: int) -> int:
    return hash((digest, token))  # tuples of ints hash the same in every process


def next_token(digest: int) -> int:
    return digest % VOCAB


def reference(prompt, max_tokens, *, eos=(), stop=(), ignore_eos=False, min_tokens=0) -> tuple[list[int], str]:
    """What one request generates alone, straight from the model function (no scheduler)."""
    d = 0
    for t in prompt:
        d = fold(d, t)
    out: list[int] = []
    while True:
        t = next_token(d)
        out.append(t)
        d = fold(d, t)
        if len(out) >= min_tokens:
            if (not ignore_eos and t in eos) or t in stop:
                return out, "stop"
            if len(out) >= max_tokens:
                return out, "length"


# -- a fake worker that keeps its own state per docs/protocol.md, execute_model and validates every step --------------

class WireError(AssertionError):
    pass


def expect(cond: bool, msg: str) -> None:
    if not cond:
        raise WireError(msg)


STEP_KEYS = {"scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "total_num_scheduled_tokens",
             "scheduled_spec_decode_tokens", "num_common_prefix_blocks", "finished_req_ids", "preempted_req_ids",
             "scheduled_encoder_inputs", "free_encoder_mm_hashes"}
NEW_KEYS = {"req_id", "prompt_token_ids", "sampling_params", "block_ids", "num_computed_tokens", "lora_request",
            "mm_features"}
CACHED_KEYS = {"req_ids", "resumed_req_ids", "new_token_ids", "new_block_ids", "num_computed_tokens",
               "num_output_tokens"}


@dataclass
class WReq:
    prompt: list[int]
    table: list[int]
    computed: int
    outputs: list[int] = field(default_factory=list)  # what this worker sampled for it
    digests: list[int] = field(default_factory=list)  # digests[p]: of tokens[: p + 1], what K/V at p depends on
    live: bool = True  # False from preemption until resumed: its table is stale meanwhile

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs

    def digest(self, p: int) -> int:
        tokens = self.tokens
        while len(self.digests) <= p:
            i = len(self.digests)
            self.digests.append(fold(self.digests[-1] if self.digests else 0, tokens[i]))
        return self.digests[p]


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.reqs: dict[str, WReq] = {}
        self.slots: dict[int, int] = {}  # slot -> digest of the K/V "written" there
        self.steps: list[dict] = []
        self.chunks = 0  # rows that computed part of the known tokens and sampled nothing

    def slot(self, st: WReq, p: int) -> int:
        return st.table[p // self.block_size] * self.block_size + p % self.block_size

    def __call__(self, so: dict) -> dict:
        self.steps.append(pickle.loads(pickle.dumps(so)))  # as sent: a deep copy, several times faster than deepcopy
        bs = self.block_size
        expect(set(so) == STEP_KEYS, f"step keys {sorted(so)}")
        expect(so["scheduled_spec_decode_tokens"] == {} and so["num_common_prefix_blocks"] == [0], "spec/prefix fields")
        for rid in so["finished_req_ids"]:  # dropped first
            expect(rid in self.reqs, f"finished {rid!r} was never sent")
            del self.reqs[rid]
        for rid in so["preempted_req_ids"]:
            expect(rid in self.reqs and self.reqs[rid].live, f"preempted {rid!r} is not running")
            self.reqs[rid].live = False

        rows: list[tuple[str, WReq]] = []
        for nr in so["scheduled_new_reqs"]:
            expect(set(nr) == NEW_KEYS, f"new req keys {sorted(nr)}")
            rid = nr["req_id"]
            expect(rid not in self.reqs, f"new request {rid!r} already exists")
            expect(isinstance(nr["sampling_params"], dict) and nr["lora_request"] is None, "sampling params / lora")
            expect(len(nr["block_ids"]) == 1, "one KV cache group")
            st = WReq(list(nr["prompt_token_ids"]), list(nr["block_ids"][0]), nr["num_computed_tokens"])
            self.reqs[rid] = st
            rows.append((rid, st))
        c = so["scheduled_cached_reqs"]
        expect(set(c) == CACHED_KEYS, f"cached keys {sorted(c)}")
        expect(len({len(c[k]) for k in CACHED_KEYS - {"resumed_req_ids"}}) == 1, "cached lists differ in length")
        expect(set(c["resumed_req_ids"]) <= set(c["req_ids"]), "resumed but not scheduled")
        for i, rid in enumerate(c["req_ids"]):
            st = self.reqs.get(rid)
            expect(st is not None, f"cached request {rid!r} unknown")
            expect(c["new_token_ids"][i] == [], "new_token_ids must be empty")
            expect(c["num_output_tokens"][i] == len(st.outputs), f"{rid}: num_output_tokens")
            nb = c["new_block_ids"][i]
            expect(nb is None or (len(nb) == 1 and len(nb[0]) > 0), f"{rid}: new_block_ids {nb}")
            if rid in c["resumed_req_ids"]:
                expect(not st.live and nb is not None, f"{rid}: resumed without preemption or table")
                st.table, st.live = list(nb[0]), True
            else:
                expect(st.live, f"{rid}: preempted request continued without resuming")
                expect(c["num_computed_tokens"][i] == st.computed, f"{rid}: num_computed_tokens jumped")
                st.table += nb[0] if nb is not None else []
            st.computed = c["num_computed_tokens"][i]
            rows.append((rid, st))

        nst = so["num_scheduled_tokens"]
        ids = [rid for rid, _ in rows]
        expect(len(ids) == len(set(ids)) and set(ids) == set(nst), "scheduled ids vs num_scheduled_tokens")
        expect(sum(nst.values()) == so["total_num_scheduled_tokens"], "total_num_scheduled_tokens")
        expect(not set(ids) & set(so["preempted_req_ids"]), "preempted and scheduled in one step")

        written: dict[int, str] = {}
        for rid, st in rows:
            start, end = st.computed, st.computed + nst[rid]
            expect(nst[rid] >= 1 and start >= 0 and end <= len(st.tokens),
                   f"{rid}: tokens [{start}, {end}) of {len(st.tokens)} known")
            expect(all(0 <= b < self.num_blocks for b in st.table), f"{rid}: block id out of range")
            expect(len(set(st.table)) == len(st.table), f"{rid}: block twice in a table")
            expect(len(st.table) * bs >= end, f"{rid}: table of {len(st.table)} blocks too short for {end}")
            # Every computed position must hold this request's K/V: catches wrong prefix hits and
            # blocks that another request overwrote.
            if start:
                st.digest(start - 1)  # st.digests[:start] filled
                held = [self.slots.get(self.slot(st, p)) for p in range(start)]
                stale = next((p for p in range(start) if held[p] != st.digests[p]), None)
                expect(stale is None, f"{rid}: stale K/V at position {stale}")
            for b in {st.table[p // bs] for p in range(start, end)}:
                expect(written.setdefault(b, rid) == rid, f"block {b} written by {rid} and {written[b]}")
        for rid, st in self.reqs.items():  # a written block is owned by its writer alone
            if st.live:
                for b in st.table:
                    expect(written.get(b, rid) == rid, f"{written.get(b)} writes block {b} held by {rid}")

        sampled: list[list[int]] = []
        for rid, st in rows:
            end = st.computed + nst[rid]
            for p in range(st.computed, end):
                self.slots[self.slot(st, p)] = st.digest(p)
            st.computed = end
            if end == len(st.tokens):  # sample only at the end of the known tokens
                st.outputs.append(next_token(st.digest(end - 1)))
                sampled.append([st.outputs[-1]])
            else:
                sampled.append([])
                self.chunks += 1
        return {"req_ids": ids, "req_id_to_index": {rid: i for i, rid in enumerate(ids)}, "sampled_token_ids": sampled,
                "logprobs": None, "prompt_logprobs_dict": {}, "num_nans_in_logits": None}


# -- driving -----------------------------------------------------------------------------------

def make_scheduler(**kw) -> tuple[Scheduler, FakeWorker]:
    sched = Scheduler(**kw)
    return sched, FakeWorker(kw["num_blocks"], kw["block_size"])


def drive(sched: Scheduler, worker: FakeWorker, arrivals: list[tuple[int, Request]], hook=None) -> dict[str, Request]:
    """Run to completion, adding each request at its step; checks budgets and blocks every step.
    hook() runs after each step (it may abort requests)."""
    pending = sorted(arrivals, key=lambda a: a[0])
    seen: dict[str, Request] = {}
    step = 0
    while pending or sched.has_unfinished() or sched.has_finished_ids():
        if not (sched.has_unfinished() or sched.has_finished_ids()):
            step = max(step, pending[0][0])  # idle: jump to the next arrival
        while pending and pending[0][0] <= step:
            req = pending.pop(0)[1]
            sched.add_request(req)
            seen[req.req_id] = req
        out = sched.schedule()
        nst = out["num_scheduled_tokens"]
        assert out["total_num_scheduled_tokens"] <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs and len(nst) <= sched.max_num_seqs
        if sched.long_prefill_token_threshold:
            assert all(n <= sched.long_prefill_token_threshold for n in nst.values())
        sched.update_from_output(out, worker(out))
        sched.blocks.check(sched.running)  # waiting and preempted requests hold no blocks
        if hook is not None:
            hook()
        step += 1
        assert step < 100_000, "no progress"
    assert not worker.reqs, "the worker still holds finished requests"
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks, "block leak"
    assert not sched.requests
    return seen


def solo(req: Request, eos=()) -> tuple[list[int], str]:
    """The same request alone, with budgets that never chunk, preempt or share."""
    r = Request(req.req_id, req.prompt_token_ids, dict(req.sampling_params), req.max_tokens, req.stop_token_ids,
                req.ignore_eos)
    blocks = 2 + (len(r.prompt_token_ids) + r.max_tokens) // 16  # its whole sequence, and a spare
    sched = Scheduler(num_blocks=blocks, block_size=16, max_num_batched_tokens=100_000, eos_token_ids=eos)
    worker = FakeWorker(blocks, 16)
    sched.add_request(r)
    done = run(sched, worker)
    assert len(worker.steps) == len(r.output_token_ids) + 1  # one prefill, decodes, the final flush
    return done[r.req_id].output_token_ids, done[r.req_id].finish_reason


def hits(worker: FakeWorker) -> dict[str, list[int]]:
    """num_computed_tokens sent each time a request was (re)admitted: its prefix-cache hits."""
    out: dict[str, list[int]] = {}
    for so in worker.steps:
        for nr in so["scheduled_new_reqs"]:
            out.setdefault(nr["req_id"], []).append(nr["num_computed_tokens"])
        c = so["scheduled_cached_reqs"]
        for i, rid in enumerate(c["req_ids"]):
            if rid in c["resumed_req_ids"]:
                out.setdefault(rid, []).append(c["num_computed_tokens"][i])
    return out


def check_preemption_order(worker: FakeWorker) -> int:
    """Replays admissions from the wire and asserts every victim was the most recently admitted
    running request. Returns the number of preemptions checked."""
    running: list[str] = []  # admission order
    checked = 0
    for so in worker.steps:
        running = [r for r in running if r not in so["finished_req_ids"]]
        for victim in so["preempted_req_ids"]:
            assert running and running[-1] == victim, (victim, running)
            running.pop()
            checked += 1
        c = so["scheduled_cached_reqs"]
        # Preempted requests wait at the front of the queue, so resumed ones are admitted before new ones.
        running += [r for r in c["req_ids"] if r in c["resumed_req_ids"]]
        running += [nr["req_id"] for nr in so["scheduled_new_reqs"]]
    return checked


def random_workload(seed: int):
    rng = random.Random(seed)
    bases = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(3)]
    reqs = []
    for i in range(rng.randint(4, 16)):
        head = rng.choice(bases)[: rng.randint(0, 40)] if rng.random() < 0.7 else []
        prompt = head + [rng.randrange(VOCAB) for _ in range(rng.randint(0 if head else 1, 12))]
        stop = tuple(rng.sample(range(VOCAB), rng.choice([0, 0, 1])))
        params = {"temperature": 0.0, "min_tokens": rng.choice([0, 0, 2])}
        req = Request(f"r{i}", prompt, params, rng.randint(2, 24), stop, ignore_eos=rng.random() < 0.3)
        reqs.append((rng.randint(0, 30), req))
    bs = rng.choice([1, 2, 4, 8, 16])
    need = max(-(-(len(r.prompt_token_ids) + r.max_tokens - 1) // bs) for _, r in reqs)
    kw = dict(num_blocks=need + rng.randint(0, need), block_size=bs, max_num_seqs=rng.choice([1, 2, 4, 16]),
              max_num_batched_tokens=rng.choice([1, 3, 8, 32, 256]), eos_token_ids=(0,),
              enable_prefix_caching=rng.random() < 0.75, long_prefill_token_threshold=rng.choice([0, 0, 5]))
    return reqs, kw
