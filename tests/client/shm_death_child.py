#!/usr/bin/env python3
"""Python trainers that die without flushing, for client_shm_death_test
(shm_death_test.cpp), which starts the real steptraced, runs this script with
STEPTRACE_LIBRARY and PYTHONPATH (the bindings dir) set, and reads the counts back with
`report --json --pid N`.

    shm_death_child.py exit SOCKET SPANS
        connect; one warm-up Backward span; flush(5000); SPANS Forward spans; os._exit(0).
    shm_death_child.py pool SOCKET OUTFILE WORKERS TASKS terminate|exit
        A multiprocessing Pool (fork start method) of WORKERS processes runs TASKS tasks,
        task i recording 1000 + 37 * i Forward spans in its worker and returning
        (worker pid, spans). "terminate": pool.terminate() (SIGTERM to idle workers);
        "exit": maxtasksperchild=1, each worker leaves after one task through
        multiprocessing's os._exit. Either way no worker flushes.
    shm_death_child.py dataloader SOCKET OUTFILE ITEMS
        torch.utils.data.DataLoader(num_workers=2, persistent_workers=False, fork): each
        __getitem__ records one Forward span in its worker; the workers are shut down
        after the epoch (os._exit, no flush). Exit 77 when torch cannot be imported.

Each worker first connects, records one warm-up Backward span and flushes, so its ring is
attached to the daemon before it records what is counted. The parent does the same and
records PARENT_SPANS Backward spans before it forks (a trainer's library is busy when its
workers are made), then flushes them and exits normally. OUTFILE (JSON): {"parent": pid,
"parent_spans": n, "workers": {"pid": Forward spans recorded there}}.

Exit 1, with a message, when a flush failed (a worker's is reported back with its results)
or the results do not add up."""

import json
import os
import sys

import steptrace

PARENT_SPANS = 25

_flush_rc = None  # a worker's warm-up flush


def warm_up(sock):
    """Connected, and this thread's ring handed to the daemon: 0 or the failed -errno."""
    rc = steptrace.connect(sock)
    if rc != 0:
        return rc
    with steptrace.span("Backward"):
        pass
    return steptrace.flush(5000)


def worker_init(sock):
    global _flush_rc
    _flush_rc = warm_up(sock)


def pool_task(spans):
    forward = steptrace.span("Forward")
    for _ in range(spans):
        with forward:
            pass
    return os.getpid(), spans, _flush_rc


def parent_start(sock):
    rc = warm_up(sock)
    if rc != 0:
        sys.exit("parent flush failed: %d" % rc)
    for _ in range(PARENT_SPANS):
        with steptrace.span("Backward"):
            pass


def parent_finish(outfile, workers):
    rc = steptrace.flush(10000)
    if rc != 0:
        sys.exit("parent's final flush failed: %d" % rc)
    with open(outfile + ".tmp", "w") as f:
        json.dump({"parent": os.getpid(), "parent_spans": PARENT_SPANS + 1,
                   "workers": {str(pid): n for pid, n in workers.items()}}, f)
    os.rename(outfile + ".tmp", outfile)


def tally(results):
    workers = {}
    for pid, spans, rc in results:
        if rc != 0:
            sys.exit("worker %d: warm-up flush failed: %r" % (pid, rc))
        workers[pid] = workers.get(pid, 0) + spans
    return workers


def run_exit(sock, spans):
    rc = warm_up(sock)
    if rc != 0:
        sys.exit("flush failed: %d" % rc)
    forward = steptrace.span("Forward")
    for _ in range(spans):
        with forward:
            pass
    os._exit(0)


def run_pool(sock, outfile, processes, tasks, how):
    import multiprocessing
    parent_start(sock)
    ctx = multiprocessing.get_context("fork")
    sizes = [1000 + 37 * i for i in range(tasks)]
    if how == "terminate":
        pool = ctx.Pool(processes, initializer=worker_init, initargs=(sock,))
        results = pool.map(pool_task, sizes, chunksize=1)
        pool.terminate()
    else:
        pool = ctx.Pool(processes, initializer=worker_init, initargs=(sock,),
                        maxtasksperchild=1)
        results = pool.map(pool_task, sizes, chunksize=1)
        pool.close()
    pool.join()
    parent_finish(outfile, tally(results))


def run_dataloader(sock, outfile, items):
    try:
        import torch.utils.data
    except ImportError as e:
        print("torch cannot be imported: %s" % e, file=sys.stderr)
        sys.exit(77)

    class Items(torch.utils.data.Dataset):
        def __init__(self, n):
            self.n = n
            self.forward = steptrace.span("Forward")

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            with self.forward:
                pass
            return os.getpid(), i, _flush_rc

    parent_start(sock)
    loader = torch.utils.data.DataLoader(
        Items(items), batch_size=None, num_workers=2, persistent_workers=False,
        multiprocessing_context="fork", worker_init_fn=lambda _: worker_init(sock))
    results = []
    seen = set()
    for pid, i, rc in loader:  # one epoch; then the workers are shut down
        pid, i, rc = int(pid), int(i), int(rc)
        if i in seen:
            sys.exit("item %d came twice" % i)
        seen.add(i)
        results.append((pid, 1, rc))
    if len(seen) != items:
        sys.exit("%d of %d items came" % (len(seen), items))
    parent_finish(outfile, tally(results))


def main(argv):
    mode = argv[1]
    if mode == "exit":
        run_exit(argv[2], int(argv[3]))
    elif mode == "pool":
        run_pool(argv[2], argv[3], int(argv[4]), int(argv[5]), argv[6])
    elif mode == "dataloader":
        run_dataloader(argv[2], argv[3], int(argv[4]))
    else:
        sys.exit("unknown mode %r" % mode)


if __name__ == "__main__":
    main(sys.argv)
