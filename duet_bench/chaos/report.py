"""The chaos soak's verdict: outcome counts, per-fault recovery, what was held at the end; a table and a JSON."""

from __future__ import annotations

from duet_bench.chaos.soak import OUTCOMES, RECOVERY_BOUND_S
from cluster.report import fmt, format_table


def summary(raw: dict, *, rate: float, duration_s: float) -> dict:
    """Counts and the pass/fail of the soak's bar: 0 hung, 0 wrong, 0 untyped, nothing held (no KV block, no queued
    request, no worker outliving its serve or head, no process of the soak's own Ray head after the soak), every
    fault recovered within :data:`RECOVERY_BOUND_S`."""
    recs = raw["records"]
    counts = {o: sum(r["outcome"] == o for r in recs) for o in OUTCOMES}
    retried = sum(r["attempts"] > 1 for r in recs)
    first_errors: dict[str, int] = {}
    for r in recs:
        for e in r["errors"][:1]:
            name = e.split(":", 1)[0]
            first_errors[name] = first_errors.get(name, 0) + 1
    end = raw["end"] | {"head_processes_left": len((raw.get("head") or {}).get("left", []))}
    recov = [f["recovery_s"] for f in raw["faults"]]
    checks = {"no_hung": counts["hung"] == 0, "no_wrong": counts["wrong"] == 0, "no_untyped": counts["untyped"] == 0,
              "nothing_held": not end.get("blocks_held") and not end.get("queued") and not end.get("in_flight")
              and not end.get("orphan_workers") and not end["head_processes_left"],
              "recovered_in_bound": all(x is not None and x <= RECOVERY_BOUND_S for x in recov)}
    return {"rate": rate, "duration_s": duration_s, "requests": len(recs), "achieved_rate": len(recs) / duration_s,
            "outcomes": counts, "retried": retried, "first_errors": first_errors, "storm": raw["storm"],
            "faults": raw["faults"], "end": end, "checks": checks, "ok": all(checks.values()),
            "startup_s": raw.get("startup_s"), "serve_starts": raw.get("serve_starts"), "proxy": raw.get("proxy"),
            "head": raw.get("head"),
            "examples": [r for r in recs if r["outcome"] != "correct"][:20]}


def tables(s: dict) -> str:
    o = s["outcomes"]
    head = format_table(["rate", "requests", "correct", "typed error", "hung", "wrong", "untyped", "retried",
                         "aborted (storms)"],
                        [[f"{s['rate']:g}/s", *map(str, (s["requests"], o["correct"], o["typed"], o["hung"],
                                                         o["wrong"], o["untyped"], s["retried"],
                                                         sum(s["storm"].values())))]])
    faults = format_table(["#", "fault", "at s", "detail", "recovery s", f"<= {RECOVERY_BOUND_S:g} s"],
                          [[str(i + 1), f["kind"], fmt(f["at_s"], 1), f.get("detail", ""), fmt(f["recovery_s"], 1),
                            "yes" if f["recovery_s"] is not None and f["recovery_s"] <= RECOVERY_BOUND_S else "NO"]
                           for i, f in enumerate(s["faults"])])
    e = s["end"]
    end = (f"end state: {e.get('blocks_held')} KV blocks held, {e.get('queued')} queued/running/receiving, "
           f"{e.get('in_flight')} in flight, {e.get('workers_alive')}/{e.get('workers')} workers alive, "
           f"{e.get('orphan_workers')} worker processes outliving their serve or head, "
           f"{e.get('head_processes_left', 0)} processes of the soak's Ray head left after it")
    verdict = "PASS" if s["ok"] else "FAIL " + ", ".join(k for k, v in s["checks"].items() if not v)
    return "\n".join([head, faults, end, f"first errors: {s['first_errors'] or '-'}", f"verdict: {verdict}"])
