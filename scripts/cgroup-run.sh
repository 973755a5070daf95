# cgroup-run.sh: sourced by the side-by-side scripts (llama-stream-compare, colibri-compare) to run
# one engine at a time in a memory cgroup (v1) with a cold page cache. Set CAP (e.g. 8G), W (seconds
# before a run is killed) and B (a folder for run.out / run.err) first, then call cgroup_open.
# Needs root; the cgroup is removed at exit.

cgroup_open() {
    CG=/sys/fs/cgroup/memory/moe-compare.$$
    mkdir "$CG"
    trap 'rmdir "$CG" 2>/dev/null || true' EXIT
    echo "$CAP" > "$CG/memory.limit_in_bytes"
}

# the cgroup's peak memory in bytes since the last run began
peak() { cat "$CG/memory.max_usage_in_bytes"; }

# bytes read from the whole disks so far (/proc/diskstats; the machine otherwise idle)
disk_read_bytes() { awk '$3 ~ /^([shv]d[a-z]+|xvd[a-z]+|nvme[0-9]+n[0-9]+|mmcblk[0-9]+)$/ {s += $6} END {printf "%.0f\n", s * 512}' /proc/diskstats; }

# runs "$@" in the cgroup after dropping the page cache, killed after $W seconds ($RUN_LABEL, or
# the command's name, names it in a failure's line); stdout into
# $B/run.out, stderr into $B/run.err, the disk's bytes read over the run into RUN_DISK_BYTES and
# its seconds into RUN_SECONDS; 1 (with what it did said on stdout) when it failed or ran out of time
in_cgroup() {
    sync
    echo 3 > /proc/sys/vm/drop_caches
    echo 0 > "$CG/memory.max_usage_in_bytes"
    local d0 t0 rc=0
    d0=$(disk_read_bytes) t0=$(date +%s.%N)
    timeout -s KILL "$W" bash -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' _ "$CG" "$@" > "$B/run.out" 2> "$B/run.err" || rc=$?
    RUN_DISK_BYTES=$(($(disk_read_bytes) - d0))
    RUN_SECONDS=$(awk "BEGIN {print $(date +%s.%N) - $t0}")
    [ $rc -eq 0 ] && return 0
    echo "{\"engine\": \"${RUN_LABEL:-$(basename "$1")}\", \"failed\": \"$([ $rc -eq 137 ] && echo "killed after $W s" || echo "exit $rc")\"," \
         "\"disk_bytes\": $RUN_DISK_BYTES, \"peak_bytes\": $(peak), \"last_line\": \"$(grep -v '^\s*$' "$B/run.err" | tail -1 | tr -d '"\\' | cut -c1-200)\"}"
    return 1
}
