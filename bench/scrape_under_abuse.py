#!/usr/bin/env python3
"""Times /metrics scrapes of `keel replay --serve-metrics` while hostile clients hold connections.

Cases (each on a fresh exporter):
  idle  N clients connect and send nothing, then one scrape is timed;
  drip  N clients send a request head one byte every --drip-interval seconds and never finish it,
        reconnecting as soon as the server drops them; scrapes are timed while they drip.
Prints one JSON object per case: the scrape seconds (null when a scrape failed) and the status.
Usage: bench/scrape_under_abuse.py [--keel build/bin/keel] [--address 127.0.0.1:0]
       [--idle 200] [--drip 40] [--scrapes 5]
"""

import argparse
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request


def start_exporter(keel, address):
    process = subprocess.Popen(
        [keel, "replay", "--trace", "synthetic", "--policy", "static", "--serve-metrics", address,
         "--serve-seconds", "600", "--quiet"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in process.stderr:
        found = re.search(r"serving metrics on http://(\S+)/metrics", line)
        if found:
            threading.Thread(target=process.stderr.read, daemon=True).start()
            return process, found.group(1)
    process.wait()
    sys.exit(f"scrape_under_abuse: the exporter did not start on {address}")


def split_address(address):
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def connect(address):
    host, port = split_address(address)
    return socket.create_connection((host, port), timeout=10)


def timed_scrape(address, timeout):
    start = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as response:
            body = response.read().decode()
            ok = response.status == 200 and "keel_steps_total" in body
            return time.monotonic() - start, "200" if ok else f"{response.status} without keel"
    except Exception as error:  # a timeout or a refused connection is a result here
        return None, type(error).__name__


def idle_case(address, clients, timeout):
    sockets = [connect(address) for _ in range(clients)]
    seconds, status = timed_scrape(address, timeout)
    for s in sockets:
        s.close()
    return {"case": "idle", "clients": clients, "scrape_seconds": [seconds], "status": [status]}


def drip_case(address, clients, scrapes, interval, timeout):
    stop = threading.Event()
    head = b"GET /metrics HTTP/1.1\r\nX-Drip: " + b"a" * 100000

    def drip():
        while not stop.is_set():
            try:
                s = connect(address)
            except OSError:
                time.sleep(interval)
                continue
            try:
                for byte in head:
                    if stop.wait(interval):
                        break
                    s.send(bytes([byte]))
            except OSError:
                pass  # dropped by the server: come back at once
            finally:
                s.close()

    threads = [threading.Thread(target=drip, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(2 * interval + 0.5)  # every dripper connected and dripping
    results = [timed_scrape(address, timeout) for _ in range(scrapes)]
    stop.set()
    for thread in threads:
        thread.join()
    return {"case": "drip", "clients": clients, "interval_seconds": interval,
            "scrape_seconds": [r[0] for r in results], "status": [r[1] for r in results]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keel", default="build/bin/keel")
    parser.add_argument("--address", default="127.0.0.1:0")
    parser.add_argument("--idle", type=int, default=200, help="idle clients (0: skip the case)")
    parser.add_argument("--drip", type=int, default=40, help="dripping clients (0: skip)")
    parser.add_argument("--drip-interval", type=float, default=0.2)
    parser.add_argument("--scrapes", type=int, default=5, help="timed scrapes while dripping")
    parser.add_argument("--timeout", type=float, default=60, help="seconds a scrape may take")
    args = parser.parse_args()

    cases = []
    if args.idle > 0:
        cases.append(lambda address: idle_case(address, args.idle, args.timeout))
    if args.drip > 0:
        cases.append(lambda address: drip_case(address, args.drip, args.scrapes,
                                               args.drip_interval, args.timeout))
    for case in cases:
        process, address = start_exporter(args.keel, args.address)
        try:
            print(json.dumps(case(address)), flush=True)
        finally:
            process.terminate()
            process.wait()


if __name__ == "__main__":
    main()
