#!/usr/bin/env bash
# What the machine itself charges for the steps every server on it pays
# per unit of work, to read the harness's ratios by (a ratio to dnsmasq or
# to a relay says little about Palisade where the kernel's share is most
# of both):
#
#   sudo bench/machine.sh [N]
#
# Prints, each measured twice on CPU 1, in nanoseconds:
#   - a system call that does nothing (`getppid`);
#   - a round trip between two processes on one core over pipes: two
#     context switches and four one-byte system calls;
#   - one 520-byte record (an evidence line's size) appended with
#     `write(2)` to a file in the evidence directory's file system (DIR,
#     default: a temporary directory under /var/tmp), to the same with its
#     blocks reserved first (`fallocate` with `KEEP_SIZE`), with `pwrite`
#     into a file already sized, to tmpfs (/dev/shm) and to /dev/null.
# N (default 200000) appends or round trips per measurement; every loop is
# bounded by it. Needs a C compiler (cc) and taskset.
set -euo pipefail
N=${1:-200000}
DIR=${DIR:-/var/tmp}
for t in cc taskset; do
  command -v "$t" >/dev/null || { echo "missing: $t" >&2; exit 1; }
done
work=$(mktemp -d /tmp/palisade-machine.XXXXXX)
files=$(mktemp -d "$DIR/palisade-machine.XXXXXX")
shm=$(mktemp -d /dev/shm/palisade-machine.XXXXXX)
trap 'rm -rf "$work" "$files" "$shm"' EXIT

cat >"$work/probe.c" <<'C'
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void die(const char *what) {
  perror(what);
  exit(1);
}

/* mode: 0 append, 1 append after fallocate KEEP_SIZE, 2 pwrite into a sized file */
static double appends(const char *path, int mode, long n) {
  int flags = O_WRONLY | O_CREAT | O_TRUNC | (mode == 2 ? 0 : O_APPEND);
  int fd = open(path, flags, 0640);
  if (fd < 0) die(path);
  if (mode == 1 && fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, (off_t)n * 520) != 0) die("fallocate");
  if (mode == 2 && ftruncate(fd, (off_t)n * 520) != 0) die("ftruncate");
  char line[520];
  memset(line, 'a', sizeof line - 1);
  line[sizeof line - 1] = '\n';
  double t0 = now();
  for (long i = 0; i < n; i++) {
    ssize_t w = mode == 2 ? pwrite(fd, line, sizeof line, (off_t)i * 520) : write(fd, line, sizeof line);
    if (w != (ssize_t)sizeof line) die("write");
  }
  double t1 = now();
  close(fd);
  return (t1 - t0) * 1e9 / n;
}

int main(int argc, char **argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: probe N FILE SHMFILE NULL\n");
    return 2;
  }
  long n = atol(argv[1]);
  if (n <= 0) return 2;
  double t0 = now();
  for (long i = 0; i < n; i++) syscall(SYS_getppid);
  printf("%-58s %8.0f\n", "null system call (getppid)", (now() - t0) * 1e9 / n);

  int a[2], b[2];
  if (pipe(a) || pipe(b)) die("pipe");
  char c = 0;
  pid_t child = fork();
  if (child < 0) die("fork");
  if (child == 0) {
    for (long i = 0; i < n; i++)
      if (read(a[0], &c, 1) != 1 || write(b[1], &c, 1) != 1) _exit(1);
    _exit(0);
  }
  t0 = now();
  for (long i = 0; i < n; i++)
    if (write(a[1], &c, 1) != 1 || read(b[0], &c, 1) != 1) die("pipe round trip");
  double rt = (now() - t0) * 1e9 / n;
  waitpid(child, NULL, 0);
  printf("%-58s %8.0f\n", "round trip between two processes on one core", rt);

  printf("%-58s %8.0f\n", "520-byte append, write(2), DIR", appends(argv[2], 0, n));
  printf("%-58s %8.0f\n", "520-byte append after fallocate(KEEP_SIZE), DIR", appends(argv[2], 1, n));
  printf("%-58s %8.0f\n", "520-byte pwrite into a file already sized, DIR", appends(argv[2], 2, n));
  printf("%-58s %8.0f\n", "520-byte append, write(2), tmpfs", appends(argv[3], 0, n));
  printf("%-58s %8.0f\n", "520-byte write(2) to /dev/null", appends(argv[4], 0, n));
  unlink(argv[2]);
  unlink(argv[3]);
  return 0;
}
C
cc -O2 -o "$work/probe" "$work/probe.c"
echo "ns per operation on CPU 1 (DIR=$files, $(df -T "$files" | awk 'NR==2{print $2}'))"
for run in 1 2; do
  echo "== run $run"
  taskset -c 1 "$work/probe" "$N" "$files/records" "$shm/records" /dev/null
done
