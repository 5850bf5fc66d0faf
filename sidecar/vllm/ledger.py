"""What the worker class knows of the sidecar's state, fed from every applied step: each live
request's tokens, block tables and computed count, and which request last wrote each KV block.

vLLM's scheduler owns the blocks and the prefix cache, but every SchedulerOutput and every reply
passes through the worker class, so from them alone the KV content of every block can be
described: the tokens [0, computed) of the request that last wrote it. After a sidecar restart
(sidecar/vllm/recovery.py) that is enough to write every block back: `refill_steps` turns the
record into ordinary prefill steps (chunks that end before a request's last known token, so
nothing is sampled). A request's images go with it: the ledger keeps each image's processed
tensors (by identifier, as vLLM sends them once) while a request that may be refilled holds it,
and the refill has the new instance encode them again. Plain data in, wire maps out: no vLLM, no MLX.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

REFILL_PREFIX = "mlx-sidecar-refill-"


def span(f: dict) -> tuple[int, int]:
    """The positions [start, end) of a wire item's placeholder."""
    return f["mm_position"]["offset"], f["mm_position"]["offset"] + f["mm_position"]["length"]


def reached(items: list[dict], lo: int, hi: int) -> list[int]:
    """The indices of the items whose placeholder overlaps positions [lo, hi)."""
    return [j for j, f in enumerate(items) if span(f)[0] < hi and span(f)[1] > lo]


@dataclass(eq=False)
class Req:
    req_id: str
    prompt: list[int]
    outputs: list[int]
    sampling_params: dict
    lora_request: dict | None
    tables: list[list[int]]  # one block table per KV cache group
    computed: int = 0
    created: int = 0  # the step that scheduled it first (a live request refills after the ones it hit)
    last_write: int = 0  # the step that last wrote one of its blocks (a chain's refill order)
    mm_features: list[dict] = field(default_factory=list)  # the wire items, without their tensors

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs


@dataclass
class Ledger:
    block_size: int
    live: dict[str, Req] = field(default_factory=dict)
    parked: dict[str, Req] = field(default_factory=dict)  # preempted: vLLM resumes them by id
    owner: dict[int, Req] = field(default_factory=dict)  # group-0 block id -> the request that last wrote it
    steps: int = 0
    tensors: dict[str, dict] = field(default_factory=dict)  # image identifier -> its processed tensors (wire)

    def clear(self) -> None:
        """The sidecar dropped every request (init_device, initialize_cache, sleep)."""
        self.live.clear()
        self.parked.clear()
        self.owner.clear()
        self.tensors.clear()

    def _write(self, r: Req, start: int, end: int) -> None:
        r.computed, r.last_write = end, self.steps
        for i in range(start // self.block_size, min(-(-end // self.block_size), len(r.tables[0]))):
            self.owner[r.tables[0][i]] = r

    def apply(self, so: dict, out: dict | None) -> None:
        """One applied step: the wire scheduler_output sent and the ModelRunnerOutput it answered."""
        self.steps += 1
        for rid in so.get("finished_req_ids") or ():
            self.live.pop(rid, None)
            self.parked.pop(rid, None)
        for rid in so.get("preempted_req_ids") or ():
            if rid in self.live:
                self.parked[rid] = self.live.pop(rid)
        n = so["num_scheduled_tokens"]
        for nr in so.get("scheduled_new_reqs") or ():
            known = nr.get("prefill_token_ids") or nr["prompt_token_ids"]
            r = Req(nr["req_id"], list(nr["prompt_token_ids"]), list(known[len(nr["prompt_token_ids"]):]),
                    nr["sampling_params"], nr.get("lora_request"), [list(t) for t in nr["block_ids"]],
                    created=self.steps, mm_features=[self._keep(f) for f in nr.get("mm_features") or ()])
            self.parked.pop(r.req_id, None)
            self.live[r.req_id] = r
            self._write(r, nr["num_computed_tokens"], nr["num_computed_tokens"] + n[r.req_id])
        c = so.get("scheduled_cached_reqs") or {}
        resumed = set(c.get("resumed_req_ids") or ())
        for i, rid in enumerate(c.get("req_ids") or ()):
            r = self.live.get(rid) or self.parked.pop(rid, None)
            if r is None:
                continue
            self.live[rid] = r
            added = c["new_block_ids"][i]
            if rid in resumed:
                r.tables = [list(t) for t in added]
            elif added is not None:
                r.tables = [t + list(a) for t, a in zip(r.tables, added)]
            start = c["num_computed_tokens"][i]
            if rid in (c.get("all_token_ids") or {}):
                r.outputs = list(c["all_token_ids"][rid][len(r.prompt):])
            elif i < len(c.get("new_token_ids") or ()) and c["new_token_ids"][i]:  # vLLM sends [] unless PP
                r.outputs = (r.tokens[:start] + list(c["new_token_ids"][i]))[len(r.prompt):]
            self._write(r, start, start + n[rid])
        for rid, toks in zip((out or {}).get("req_ids") or (), (out or {}).get("sampled_token_ids") or ()):
            r = self.live.get(rid)
            if r is not None and toks:
                r.outputs += list(toks)
                # rejected drafts were scheduled but are not computed: a sampling row ends one short
                r.computed = min(r.computed, len(r.prompt) + len(r.outputs) - 1)  # (not r.tokens: a copy per step)
        if self.tensors and so.get("finished_req_ids"):
            self._forget_images()

    def _keep(self, f: dict) -> dict:
        """A request's item without its pixels, which are kept once per identifier (vLLM sends an
        image it sent before without them, and the grid alone for one its prefix cache covers)."""
        data = f.get("data") or {}
        if "pixel_values" in data:
            self.tensors[f["identifier"]] = data
        return {**f, "data": {k: v for k, v in data.items() if k != "pixel_values"} or None}

    def _forget_images(self) -> None:
        """Drop the tensors no request that may be refilled holds any more."""
        held = {*self.live.values(), *self.parked.values(), *self.owner.values()}
        wanted = {f["identifier"] for r in held for f in r.mm_features}
        for k in [k for k in self.tensors if k not in wanted]:
            del self.tensors[k]

    def features(self, r: Req, lo: int, end: int) -> list[dict]:
        """Its items in positions [0, end), with their tensors from `lo` on (positions a new
        instance may still compute), the grid alone before."""
        out = []
        for f in r.mm_features:
            at = span(f)[1]
            if at <= end:
                out.append({**f, "data": self.tensors.get(f["identifier"], f["data"])} if at > lo else f)
        return out

    def chains(self) -> list[tuple[Req, int]]:
        """Finished (or preempted) requests whose full blocks vLLM may still hit in its prefix
        cache: (request, tokens to refill), oldest writer first, so a block written again later
        ends up with its last writer's content."""
        out = []
        live = set(map(id, self.live.values()))
        for r in sorted({id(r): r for r in self.owner.values() if id(r) not in live}.values(), key=lambda r: r.last_write):
            owned = [i for i, b in enumerate(r.tables[0]) if self.owner.get(b) is r and (i + 1) * self.block_size <= r.computed]
            if owned:
                out.append((r, (owned[-1] + 1) * self.block_size))
        return out


@dataclass
class _Item:
    req_id: str
    prompt: list[int]
    known: list[int]
    sampling_params: dict
    lora_request: dict | None
    tables: list[list[int]]
    total: int  # tokens to write
    done: int = 0  # tokens already there (a live request's prefix-cache hit, refilled by its writer)
    fake: bool = False
    mm_features: list[dict] = field(default_factory=list)

    def images(self) -> list[int]:
        """Its items the refill computes positions of: encoded when it is first scheduled."""
        return reached(self.mm_features, self.done, self.total)

    def blocks(self, bs: int) -> set[int]:
        return set(self.tables[0][: -(-self.total // bs)])


def refill_items(ledger: Ledger, prefix_cache: bool, loras: set[int]) -> list[_Item]:
    items: list[_Item] = []
    if prefix_cache:
        for k, (r, n) in enumerate(ledger.chains()):
            lora = r.lora_request
            if lora is not None and lora.get("lora_int_id") not in loras:
                continue  # its adapter is gone: vLLM evicted those blocks' hashes with it
            # One more known token (no sampling), and every image the refilled blocks reach, whole.
            end = max([n + 1, *(span(r.mm_features[j])[1] for j in reached(r.mm_features, 0, n))])
            prompt = r.tokens[:end] + [0] * (end - len(r.tokens))
            nb = -(-n // ledger.block_size)
            items.append(_Item(f"{REFILL_PREFIX}{k}", prompt, prompt, {"temperature": 0.0}, lora,
                               [t[:nb] for t in r.tables], n, fake=True, mm_features=ledger.features(r, 0, end)))
    for r in sorted(ledger.live.values(), key=lambda r: r.created):
        if r.computed > 0:
            # Leading full blocks another request wrote are this one's prefix-cache hits (vLLM does
            # not free a live request's blocks, so they still hold what it hit): their writer,
            # earlier in the order, refills them.
            hit = 0
            while (hit + 1) * ledger.block_size <= r.computed and ledger.owner.get(r.tables[0][hit], r) is not r:
                hit += 1
            done = min(hit * ledger.block_size, r.computed - 1)  # >= 1 token: it must exist there
            items.append(_Item(r.req_id, r.prompt, r.tokens, r.sampling_params, r.lora_request, r.tables, r.computed,
                               done=done, mm_features=ledger.features(r, done, len(r.prompt))))
    return items


def refill_steps(items: list[_Item], block_size: int, budget: int, max_seqs: int) -> Iterator[dict]:
    """Wire scheduler_outputs that write every item's tokens [0, total) into its own blocks,
    chunked within `budget` tokens and `max_seqs` rows a step. An item whose blocks overlap an
    earlier item's starts only after that one is done (the later writer wins). An item's images are
    encoded in its first step; the last step frees those no live request computes past the refill."""
    queue, active, finished = list(items), [], []
    encoded = {it.mm_features[j]["identifier"] for it in items for j in it.images()}
    needed = {f["identifier"] for it in items if not it.fake for f in it.mm_features
              if span(f)[1] > it.total}
    free = sorted(encoded - needed)
    while queue or active or finished:
        new, cached, sched = [], [], {}
        left = budget
        for it in active:
            if left <= 0:
                break
            k = min(it.total - it.done, left)
            cached.append((it, k))
            left -= k
        busy = set().union(*(it.blocks(block_size) for it in active)) if active else set()
        while queue and left > 0 and len(new) + len(cached) < max_seqs:
            it = queue[0]
            if it.blocks(block_size) & busy:
                break
            queue.pop(0)
            busy |= it.blocks(block_size)
            k = min(it.total - it.done, left)
            new.append((it, k))
            active.append(it)
            left -= k
        step = {"scheduled_new_reqs": [], "finished_req_ids": finished, "num_scheduled_tokens": sched,
                "scheduled_cached_reqs": {"req_ids": [], "new_token_ids": [], "new_block_ids": [],
                                          "num_computed_tokens": [], "num_output_tokens": [], "resumed_req_ids": []}}
        for it, k in new:
            step["scheduled_new_reqs"].append({
                "req_id": it.req_id, "prompt_token_ids": it.prompt, "prefill_token_ids": it.known,
                "sampling_params": it.sampling_params, "block_ids": it.tables, "num_computed_tokens": it.done,
                "lora_request": it.lora_request, "mm_features": it.mm_features})
        step["scheduled_encoder_inputs"] = {it.req_id: it.images() for it, _ in new if it.images()}
        c = step["scheduled_cached_reqs"]
        for it, k in cached:
            c["req_ids"].append(it.req_id)
            c["new_token_ids"].append([])
            c["new_block_ids"].append(None)
            c["num_computed_tokens"].append(it.done)
            c["num_output_tokens"].append(len(it.known) - len(it.prompt))
        for it, k in new + cached:
            sched[it.req_id] = k
            it.done += k
        step["total_num_scheduled_tokens"] = sum(sched.values())
        finished = [it.req_id for it in active if it.done >= it.total and it.fake]
        active = [it for it in active if it.done < it.total]
        if not sched and not step["finished_req_ids"]:
            break
        yield step
    if free:
        yield {"scheduled_new_reqs": [], "num_scheduled_tokens": {}, "total_num_scheduled_tokens": 0,
               "finished_req_ids": [], "free_encoder_mm_hashes": free}
