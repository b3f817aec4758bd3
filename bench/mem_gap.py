#!/usr/bin/env python3
"""Charged state bytes vs the daemon's RSS under a render flood, and RSS after the state
is freed (issue 26: "charged bytes and RSS must agree within 25%", "RSS goes back down").

Not a timed benchmark: it starts the build's steptraced on a temporary socket with the
shipped defaults (config/steptraced.json; socket, state_dir, metrics_listen differ, and
max_exited_processes is 1 so that exited holders leave the table and their state is
freed), then
  fill:   HOLDERS raw_client processes, each 1,024 custom steps x THREADS thread ids (the
          soak's state-size bomb, smaller), held while the flood runs; a new one replaces
          each that leaves, so ingest keeps mutating records while views render;
  flood:  16 looping `report --json` and 8 keep-alive `GET /metrics` (the soak's flood);
  free:   the flood stops, the holders are killed; RSS is read after the trims.
Every second it prints VmRSS (/proc/PID/status) beside `stats --json`
memory.state_bytes_charged, the view copies, the flight recorder's bytes, the replies
pending to clients (memory.reply_bytes_pending), the metrics texts the HTTP listener holds
(memory.http_reply_bytes) and their sum, memory.accounted_bytes (for a daemon without it,
the sum of the figures it has), each over RSS.

  bench/mem_gap.py BUILD_DIR [--holders N] [--threads T] [--flood-s S] [--churn N]
"""
import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ap = argparse.ArgumentParser()
ap.add_argument("build_dir")
ap.add_argument("--holders", type=int, default=24)
ap.add_argument("--threads", type=int, default=256)
ap.add_argument("--flood-s", type=int, default=40)
ap.add_argument("--reports", type=int, default=16)
ap.add_argument("--scrapers", type=int, default=8)
ap.add_argument("--churn", type=int, default=1,
                help="short-lived holders filling at once in the flood (0: none comes or goes)")
args = ap.parse_args()

repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
daemon = os.path.join(args.build_dir, "daemon", "steptraced")
raw_client = os.path.join(args.build_dir, "tests", "server", "raw_client")
tmp = tempfile.mkdtemp(prefix="mem-gap.")
sock_path = os.path.join(tmp, "s.sock")
s = socket.socket()
s.bind(("127.0.0.1", 0))
port = s.getsockname()[1]
s.close()
config = json.load(open(os.path.join(repo, "config", "steptraced.json")))
config.update(socket=sock_path, state_dir=os.path.join(tmp, "state"), socket_mode="0666",
              metrics_listen="127.0.0.1:%d" % port)
config["limits"]["max_exited_processes"] = 1
os.mkdir(config["state_dir"])
json.dump(config, open(os.path.join(tmp, "d.json"), "w"))
proc = subprocess.Popen([daemon, "--config", os.path.join(tmp, "d.json")],
                        stderr=open(os.path.join(tmp, "log"), "w"))
for _ in range(100):
    if os.path.exists(sock_path):
        break
    time.sleep(0.1)


def ask(line):
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(60)
    c.connect(sock_path)
    c.sendall(line.encode() + b"\n")
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = c.recv(1 << 20)
        if not chunk:
            break
        reply += chunk
    c.close()
    return reply


def rss_mib():
    for line in open("/proc/%d/status" % proc.pid):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0


def sample(phase):
    stats = json.loads(ask("stats --json"))
    charged = stats["memory"]["state_bytes_charged"] / 2**20
    rss = rss_mib()
    fr = stats.get("flight_recorder", {}).get("bytes", 0) / 2**20
    copies = stats["memory"].get("view_copy_bytes", 0) / 2**20
    replies = stats["memory"].get("reply_bytes_pending", 0) / 2**20
    scrape_texts = stats["memory"].get("http_reply_bytes", 0) / 2**20
    held = stats["memory"].get("accounted_bytes")
    held = held / 2**20 if held is not None else charged + copies + fr + replies + scrape_texts
    print("%-6s %8.0f %8.0f %6.2f %6.0f %6.0f %7.0f %6.0f %6.2f %5d" % (
        phase, rss, charged, charged / rss if rss else 0, copies, fr, replies, scrape_texts,
        held / rss if rss else 0, stats["processes"]["tracked"]), flush=True)
    return rss, charged, held, copies


stop = threading.Event()
flood_on = threading.Event()
holders = []


def holder_loop():
    while not stop.is_set():
        holders[:] = [h for h in holders if h.poll() is None]
        if len(holders) < args.holders:
            holders.append(subprocess.Popen(
                [raw_client, sock_path, "good", "--threads", str(args.threads), "--pairs", "1",
                 "--custom", "bomb", "--customs", "1024", "--hold-ms", "600000"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(0.5)


def churn_loop():
    # Short-lived holders while the flood runs: ingest mutates records views hold.
    while not stop.is_set():
        if flood_on.is_set():
            subprocess.run([raw_client, sock_path, "good", "--threads", str(args.threads),
                            "--pairs", "1", "--custom", "bomb", "--customs", "1024"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            time.sleep(0.2)


done = {"reports": 0, "scrapes": 0}  # replies read whole in the flood (+= under the GIL)


def reports():
    while not stop.is_set():
        if not flood_on.is_set():
            time.sleep(0.2)
            continue
        try:
            ask("report --json")
            done["reports"] += 1
        except OSError:
            time.sleep(0.5)


def scrapes():
    while not stop.is_set():
        if not flood_on.is_set():
            time.sleep(0.2)
            continue
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            while flood_on.is_set():
                c.request("GET", "/metrics")
                c.getresponse().read()
                done["scrapes"] += 1
        except (OSError, http.client.HTTPException):
            time.sleep(0.5)


print("phase   rss_MiB charged_MiB ratio copies_MiB fr_MiB replies_MiB http_MiB "
      "accounted/rss procs", flush=True)
threads = [threading.Thread(target=holder_loop, daemon=True)]
threads += [threading.Thread(target=churn_loop, daemon=True) for _ in range(args.churn)]
threads += [threading.Thread(target=reports, daemon=True) for _ in range(args.reports)]
threads += [threading.Thread(target=scrapes, daemon=True) for _ in range(args.scrapers)]
for t in threads:
    t.start()
try:
    for _ in range(20):
        time.sleep(1)
        sample("fill")
    report_bytes = len(ask("report --json"))
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("GET", "/metrics")
    print("reply bytes: report --json %.1f MiB, metrics %.1f MiB" % (
        report_bytes / 2**20, len(c.getresponse().read()) / 2**20), flush=True)
    flood_on.set()
    ratios, helds, copies = [], [], []
    for _ in range(args.flood_s):
        time.sleep(1)
        rss, charged, held, copy = sample("flood")
        ratios.append(charged / rss)
        helds.append(held / rss)
        copies.append(copy)
    flood_on.clear()
    stop.set()
    time.sleep(2)
    sample("idle")
    for h in list(holders):
        h.kill()
    for h in list(holders):
        h.wait()
    for i in range(40):
        time.sleep(1)
        if i % 5 == 4:
            rss_after, charged_after, _, _ = sample("freed")
    print("flood charged/RSS min %.2f median %.2f max %.2f; accounted (charged + view copies + "
          "flight recorder + pending replies + HTTP scrape texts)/RSS min %.2f median %.2f max "
          "%.2f; view copies MiB "
          "median %.0f max %.0f; replies in the flood: %d reports, %d scrapes; after free "
          "RSS %.0f MiB for %.0f MiB charged" % (
              min(ratios), sorted(ratios)[len(ratios) // 2], max(ratios), min(helds),
              sorted(helds)[len(helds) // 2], max(helds), sorted(copies)[len(copies) // 2],
              max(copies), done["reports"], done["scrapes"], rss_after, charged_after))
finally:
    stop.set()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    shutil.rmtree(tmp, ignore_errors=True)
