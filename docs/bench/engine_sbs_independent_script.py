"""Independent side-by-side: Duet's LLM.generate vs vLLM's LLM.generate, each in a fresh process per round, on
random prompts unlike duet bench engine's. usage: sbs.py drive ROUNDS OUT.json | sbs.py duet|vllm MODEL WORKLOAD"""
import json, os, random, subprocess, sys, time

DUET_PY = "/work/main/.venv/bin/python"
VLLM_PY = os.path.expanduser("~/.cache/vllm-peer/bin/python")
DUET_MODEL = os.path.expanduser("~/.cache/duet/models/bench-llava-moe-v1")
VLLM_MODEL = os.path.expanduser("~/.cache/vllm-peer/models/d42578bedb41")


def workloads(seed):
    r = random.Random(seed)
    ids = lambda n: [r.randrange(10, 8000) for _ in range(n)]
    return {"1x384/96": [[ids(384), 96]], "8x200/48": [[ids(200), 48] for _ in range(8)],
            "32x64/32": [[ids(64), 32] for _ in range(32)],
            "48 mixed": [[ids(r.randint(32, 384)), r.randint(16, 96)] for _ in range(48)]}


def run_side(side, model, wl):
    cases = json.load(open(wl))
    if side == "duet":
        sys.path.insert(0, "/work/main")
        from engine import LLM, SamplingParams
        llm = LLM(model, dtype="float32")
        sp = lambda o: SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)
        gen = lambda reqs: llm.generate([{"prompt_token_ids": p} for p, _ in reqs], [sp(o) for _, o in reqs])
    else:
        from vllm import LLM, SamplingParams
        llm = LLM(model=model, dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3)
        sp = lambda o: SamplingParams(temperature=0, max_tokens=o, min_tokens=o, ignore_eos=True, detokenize=False)
        gen = lambda reqs: llm.generate([{"prompt_token_ids": p} for p, _ in reqs], [sp(o) for _, o in reqs],
                                        use_tqdm=False)
    gen([[list(range(10, 40)), 4]])  # warm-up
    res = {}
    for name, reqs in cases.items():
        t = time.perf_counter()
        outs = gen(reqs)
        dt = time.perf_counter() - t
        assert [len(o.outputs[0].token_ids) for o in outs] == [o for _, o in reqs]
        res[name] = sum(o for _, o in reqs) / dt
    print("SBS", json.dumps(res), flush=True)


def drive(rounds, out):
    doc = {"duet": [], "vllm": [], "load": [], "cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0]}
    for k in range(rounds):
        wl = f"/tmp/sbs_wl_{k}.json"
        json.dump(workloads(100 + k), open(wl, "w"))
        order = ["duet", "vllm"] if k % 2 == 0 else ["vllm", "duet"]
        for side in order:
            py, model = (DUET_PY, DUET_MODEL) if side == "duet" else (VLLM_PY, VLLM_MODEL)
            doc["load"].append(os.getloadavg()[0])
            p = subprocess.run([py, __file__, side, model, wl], capture_output=True, text=True,
                               env=os.environ | {"VLLM_LOGGING_LEVEL": "ERROR"}, timeout=1200)
            line = [l for l in p.stdout.splitlines() if l.startswith("SBS ")]
            assert line, p.stderr[-2000:]
            doc[side].append(json.loads(line[-1][4:]))
            print(k, side, doc[side][-1], flush=True)
    import statistics
    med = {s: {c: statistics.median(r[c] for r in doc[s]) for c in doc[s][0]} for s in ("duet", "vllm")}
    doc["median"] = med
    doc["ratio"] = {c: med["duet"][c] / med["vllm"][c] for c in med["duet"]}
    json.dump(doc, open(out, "w"), indent=1)
    for c in med["duet"]:
        print(f"{c:10s} duet {med['duet'][c]:8.1f}  vllm {med['vllm'][c]:8.1f}  {doc['ratio'][c]:.2f}x")


if __name__ == "__main__":
    if sys.argv[1] == "drive":
        drive(int(sys.argv[2]), sys.argv[3])
    else:
        run_side(sys.argv[1], sys.argv[2], sys.argv[3])
