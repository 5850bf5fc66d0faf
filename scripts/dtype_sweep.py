"""Offline sweep: every tiny family (sidecar/models/families.py) in every variant of
sidecar/models/variants.py, served by the sidecar (paged cache, batching, chunked prefill) against
mlx-lm's own greedy tokens on the same checkpoint. Each family runs in its own process (a crash is
a result, not the end of the sweep). Run it niced:

    nice -n 10 .venv/bin/python scripts/dtype_sweep.py [--variants bf16,q4g32] [family ...]

Prints one line per (family, variant): EQUAL, DIFF (both token lists), REFUSED (the 400) or an error.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def one(family: str, variants: list[str], home: str) -> None:
    from mlx_lm.utils import load_model

    from sidecar.errors import ProtocolError
    from sidecar.models import variants as V
    from tests.conftest import mlx_lm_greedy
    from tests.engine.test_architectures import NEW, prompts, serve_dir, tiny_dir

    src = tiny_dir(home, family)
    for v in variants:
        res: dict = {"family": family, "variant": v}
        try:
            try:
                d = V.write_variant(src, Path(home) / "variants" / f"{family}-{v}", v)
            except Exception as e:  # noqa: BLE001 (mlx-lm cannot convert it: not a sidecar result)
                res.update(result="NOCONVERT", why=f"{type(e).__name__}: {e}"[:200])
                continue
            ps = prompts(family, 256)
            try:
                oracle = load_model(d)[0]
                full = {f"r{i}": mlx_lm_greedy(oracle, p, NEW) for i, p in enumerate(ps)}
                want = {r: t for r, (t, _) in full.items()}
            except Exception as e:  # noqa: BLE001 (mlx-lm cannot run it here: the sidecar must refuse)
                res["oracle"] = f"{type(e).__name__}: {e}"[:200]
                want = None
            try:
                lps: dict = {}
                got = serve_dir(home, d, ps, logprobs=lps)
            except ProtocolError as e:
                res.update(result="REFUSED" if want is None else "REFUSED_SERVABLE", why=f"{e.status} {e.field}: {e}"[:300])
                continue
            if want is None:
                res.update(result="SERVED_WITHOUT_ORACLE")
            elif got == want:
                err = max(abs(a - b) for r, (_, lp) in full.items() for a, b in zip(lps[r], lp))
                # float32 activations (no dtype cast): logprobs within 1e-4 of mlx-lm's
                bad = V.VARIANTS[v][0] is None and err > 1e-4
                res.update(result="LOGPROBS" if bad else "EQUAL", max_logprob_err=round(err, 7))
            else:
                # mlx-lm's own tokens with its prompt in the sidecar run's chunks: if they differ
                # too, no server that chunks can match it; then whole prompts must
                split_ok = want == {f"r{i}": chunked(oracle, p) for i, p in enumerate(ps)}
                whole = serve_dir(home, d, ps, chunk=64)
                res.update(result="DIFF" if split_ok or whole != want else "DIFF_CHUNKED_ONLY", got=got, want=want,
                           gaps=gaps(oracle, ps, got, want), mlx_lm_chunked_equal=split_ok, whole_prompt_equal=whole == want)
        except Exception as e:  # noqa: BLE001
            res.update(result="ERROR", why=f"{type(e).__name__}: {e}"[:300])
        finally:
            print(json.dumps(res), flush=True)


def gaps(model, ps: list[list[int]], got: dict, want: dict) -> dict[str, float]:
    """Per differing row: at the first differing token, mlx-lm's logprob of its own token minus
    that of the sidecar's (teacher-forced on the common prefix). Near 0: a near-tie that rounding
    flips; large: a real difference."""
    import mlx.core as mx

    out = {}
    for i, p in enumerate(ps):
        r = f"r{i}"
        if got[r] == want[r]:
            continue
        k = next(j for j, (a, b) in enumerate(zip(got[r], want[r])) if a != b)
        logits = model(mx.array([p + want[r][:k]]))[0, -1].astype(mx.float32)
        lp = logits - mx.logsumexp(logits)
        out[r] = round(float(lp[want[r][k]] - lp[got[r][k]]), 5)
    return out


def chunked(model, p: list[int]) -> list[int]:
    """mlx-lm's own greedy tokens with its prompt fed in chunks of 7 (what the sweep's sidecar
    run does): whether mlx-lm agrees with itself across prefill splits on this checkpoint."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from tests.engine.test_architectures import NEW

    return [int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=NEW, prefill_step_size=7,
                                              sampler=lambda x: mx.argmax(x, axis=-1))]


def main() -> None:
    from sidecar.models import variants as V

    ap = argparse.ArgumentParser()
    ap.add_argument("families", nargs="*")
    ap.add_argument("--variants", default=",".join(V.VARIANTS))
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--home", default=None)
    a = ap.parse_args()
    variants = a.variants.split(",")
    if a.one:
        one(a.families[0], variants, a.home)
        return
    from sidecar.models import families
    from tests.engine.test_architectures import REFUSED

    home = a.home or tempfile.mkdtemp(prefix="dtype-sweep-")
    names = a.families or sorted(set(families.FAMILIES) - set(REFUSED))
    for f in names:
        p = subprocess.run([sys.executable, __file__, "--one", "--home", home, "--variants", a.variants, f],
                           capture_output=True, text=True, timeout=600)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        for ln in lines:
            print(ln, flush=True)
        if p.returncode:
            print(json.dumps({"family": f, "result": "CRASH", "rc": p.returncode,
                              "stderr": p.stderr[-400:]}), flush=True)


if __name__ == "__main__":
    main()
