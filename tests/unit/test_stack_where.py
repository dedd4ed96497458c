"""What a failed rank's message quotes from the stack faulthandler wrote
(autopar/runtime/launch.py `stack_where`): the thread the dump is about, never whichever
thread happens to be listed first. faulthandler lists Python threads newest first and heads
the one it runs on "Current thread"; a crash in a thread with no Python state (gloo's, a
BLAS pool's) has no such block. Pure parsing: no process starts."""

from __future__ import annotations

from autopar.runtime.launch import stack_where

MONITOR = """Thread 0x00007f0000000002 (most recent call first):
  File "/venv/lib/python3.11/threading.py", line 331 in wait
  File "/venv/lib/python3.11/site-packages/tqdm/_monitor.py", line 69 in run
"""
MAIN = """Thread 0x00007f0000000001 (most recent call first):
  File "/work/autopar/runtime/spmd.py", line 167 in step
  File "/work/benchmarks/probe.py", line 70 in _worker
"""


def test_a_crash_in_a_native_thread_quotes_the_main_thread_not_the_first_listed():
    dump = "Fatal Python error: Segmentation fault\n\n" + MONITOR + "\n" + MAIN + "\nExtension modules: torch\n"
    where = stack_where(dump, crashed=True)
    assert "Segmentation fault" in where and "no Python frames" in where
    assert "its main thread was at" in where and "spmd.py" in where and "step" in where
    assert "tqdm" not in where


def test_a_crash_in_a_python_thread_quotes_that_thread():
    current = MONITOR.replace("Thread 0x00007f0000000002", "Current thread 0x00007f0000000002")
    dump = "Fatal Python error: Aborted\n\n" + current + "\n" + MAIN
    where = stack_where(dump, crashed=True)
    assert where.startswith("; it crashed (Aborted) at: ") and "tqdm" in where and "spmd.py" not in where


def test_a_hung_rank_quotes_its_main_thread_where_the_signal_handler_ran():
    dump = MONITOR + "\n" + MAIN.replace("Thread 0x00007f0000000001", "Current thread 0x00007f0000000001")
    where = stack_where(dump)
    assert where.startswith("; its main thread was at: ") and "spmd.py" in where and "tqdm" not in where


def test_a_crash_after_an_earlier_stack_dump_quotes_the_crash():
    earlier = MAIN.replace("Thread 0x00007f0000000001", "Current thread 0x00007f0000000001")
    crash = "Fatal Python error: Segmentation fault\n\n" + MONITOR + "\n" + MAIN.replace("line 167 in step", "line 199 in sync")
    where = stack_where(earlier + "\n" + crash, crashed=True)
    assert "line 199 in sync" in where and "line 167" not in where and "no Python frames" in where


def test_no_dump_says_nothing():
    assert stack_where("") == "" and stack_where("", crashed=True) == ""


def test_a_real_native_thread_crash_is_told_apart_from_the_python_threads():
    # a process whose native thread (no Python state, as gloo's) jumps to a bad address
    # while a Python thread sleeps: faulthandler's own dump, parsed
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import ctypes, faulthandler, sys, threading, time
        faulthandler.enable(file=sys.stderr, all_threads=True)
        threading.Thread(target=lambda: time.sleep(30), daemon=True).start()
        time.sleep(0.2)
        tid = ctypes.c_ulong()
        ctypes.CDLL(None).pthread_create(ctypes.byref(tid), None, ctypes.c_void_p(8), None)
        time.sleep(10)  # main_thread_waits_here
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == -11, run.stderr
    assert "Current thread" not in run.stderr  # what the old parser did not expect
    where = stack_where(run.stderr, crashed=True)
    assert "Segmentation fault" in where and "no Python frames" in where
    assert "its main thread was at" in where and "line 8 in <module>" in where
    assert "lambda" not in where
