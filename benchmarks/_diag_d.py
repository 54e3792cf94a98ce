import sys, os, tempfile, time
sys.path.insert(0, "/work/main/tests"); sys.path.insert(0, "/work/main/benchmarks"); sys.path.insert(0, "/work/main")
import retiarii as rt
import e2e_workloads as w
if __name__ == "__main__":
    d = tempfile.mkdtemp()
    root = w.write_jpegs(os.path.join(d, "jpegs"), 128)
    tr = w.jpeg_trainer(root, w.sizes(False))
    import cProfile, pstats
    from engine_helpers import InProcessExecutor
    exp = rt.Experiment(w.SPACE_D, rt.strategies.GridSearch(), tr, store=os.path.join(d, "s.db"),
                        executor=InProcessExecutor(), seed=0, max_models=8)
    exp.run()
    import json, test_optimize as o
    for r in o._plans(os.path.join(d, "s.db")):
        print(r["status"], r["speedup"], r["reason"][:200])
        for u in r["units"][:1]:
            print(json.dumps({k: u.get(k) for k in ("layout", "batches", "load_s", "first_load_s", "compute_s", "setup_s", "step_s", "choice")}, default=str)[:1500])
