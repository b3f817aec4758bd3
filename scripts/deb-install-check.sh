#!/usr/bin/env bash
# Builds the Debian package with CPack from BUILD_DIR (default build), installs it on
# THIS machine with apt-get (so its Depends are resolved from Debian's archive), checks
# that the files are where the units expect them, that the units verify, that the
# documentation is there (copyright, bash completion, man pages: `man -w` only where
# man-db is installed), and that the installed daemon and CLI work together, then purges
# the package again.
#
# It changes the machine (files under /usr and /etc, a system user), so it runs only
# when CI=true (a throw-away CI machine) or STEPTRACE_DEB_INSTALL=1; otherwise it says
# so and exits 0. Usage: [CI=true] scripts/deb-install-check.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build}

if [[ ${CI:-} != true && ${STEPTRACE_DEB_INSTALL:-0} != 1 ]]; then
  echo "deb-install-check: not run: it installs and purges a package on this machine;" \
    "set CI=true or STEPTRACE_DEB_INSTALL=1 to run it"
  exit 0
fi
sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
fail() {
  echo "deb-install-check: FAILED: $*" >&2
  exit 1
}

if dpkg-query -W -f='${Status}' steptrace 2>/dev/null | grep -q "install ok installed"; then
  fail "a steptrace package is already installed here; refusing to replace it"
fi

pkgdir=$(mktemp -d)
work=$(mktemp -d)
daemon_pid=""
cleanup() {
  local status=$?
  [[ -n $daemon_pid ]] && kill "$daemon_pid" 2>/dev/null || true
  if dpkg-query -W -f='${Status}' steptrace 2>/dev/null | grep -q installed; then
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq steptrace >/dev/null || status=1
  fi
  rm -rf "$pkgdir" "$work"
  exit "$status"
}
trap cleanup EXIT

cpack -G DEB --config "$build_dir/CPackConfig.cmake" -B "$pkgdir" >"$work/cpack.log" 2>&1 ||
  { cat "$work/cpack.log"; fail "cpack -G DEB"; }
deb=$(ls "$pkgdir"/steptrace_*.deb)
echo "deb-install-check: installing $(basename "$deb") with apt-get"
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$deb" >"$work/apt.log" 2>&1 ||
  { cat "$work/apt.log"; fail "apt-get install $deb"; }

for f in /usr/bin/steptraced /usr/bin/steptrace /etc/steptrace/steptraced.json \
  /usr/include/steptrace/steptrace.h /usr/lib/sysusers.d/steptrace.conf \
  /usr/lib/tmpfiles.d/steptrace.conf; do
  [[ -e $f ]] || fail "$f is not installed"
done
units=$(dpkg -L steptrace | grep -E '/systemd/system/steptraced\.(socket|service)$' | sort)
[[ $(wc -l <<<"$units") -eq 2 ]] || fail "the package does not ship both units: $units"
exec_start=$(grep -E '^ExecStart=' $(grep service <<<"$units") | head -1)
[[ $exec_start == *"/usr/bin/steptraced"* ]] || fail "service ExecStart is not the packaged daemon: $exec_start"
# shellcheck disable=SC2086
systemd-analyze verify $units || fail "systemd-analyze verify on the installed units"
getent passwd steptrace >/dev/null || fail "postinst did not create the steptrace user"

# Documentation: the copyright file and the bash completion (which loads with plain bash).
for f in /usr/share/doc/steptrace/copyright /usr/share/bash-completion/completions/steptrace \
  /usr/share/bash-completion/completions/steptraced; do
  [[ -e $f ]] || fail "$f is not installed"
done
bash --norc --noprofile -c 'source /usr/share/bash-completion/completions/steptrace &&
  complete -p steptrace steptraced' >/dev/null || fail "the installed bash completion does not load"
# Man pages: in the package always; installed unless dpkg's path-exclude drops them (as
# in minimal container images); found by man only where man-db is installed.
contents=$(dpkg-deb -c "$deb")
for page in man1/steptrace.1.gz man8/steptraced.8.gz; do
  grep -q "/usr/share/man/$page\$" <<<"$contents" || fail "the package lacks /usr/share/man/$page"
done
if [[ ! -e /usr/share/man/man1/steptrace.1.gz ]]; then
  echo "deb-install-check: man pages not installed (dpkg path-exclude?); not checking man -w"
elif command -v man >/dev/null; then
  [[ $(man -w steptrace) == /usr/share/man/man1/steptrace.1.gz ]] || fail "man -w steptrace: $(man -w steptrace 2>&1)"
  [[ $(man -w 8 steptraced) == /usr/share/man/man8/steptraced.8.gz ]] || fail "man -w 8 steptraced: $(man -w 8 steptraced 2>&1)"
else
  echo "deb-install-check: man-db is not installed; not checking man -w"
fi

# The installed daemon with the installed default config, on a temporary socket.
/usr/bin/steptraced --config /etc/steptrace/steptraced.json --socket "$work/s.sock" \
  >"$work/daemon.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 100); do
  [[ -S $work/s.sock ]] && break
  sleep 0.1
done
reply=$(/usr/bin/steptrace --socket "$work/s.sock" ping) ||
  { cat "$work/daemon.log"; fail "steptrace ping against the installed daemon"; }
[[ $reply == pong ]] || fail "ping answered '$reply'"
# The packaged Python binding finds the packaged library through ldconfig.
STEPTRACE_SOCKET=$work/s.sock /usr/bin/python3 -c '
import sys, steptrace
steptrace.connect()
for _ in range(3):
    with steptrace.span("Forward"):
        pass
sys.exit(0 if steptrace.flush(5000) == 0 else 1)' || fail "the installed Python binding"
/usr/bin/steptrace --socket "$work/s.sock" report --json | grep -q '"count":3' ||
  fail "the installed daemon did not report the binding's 3 spans"
kill -TERM "$daemon_pid"
wait "$daemon_pid" || fail "the installed daemon did not exit 0 on SIGTERM"
daemon_pid=""

$sudo env DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq steptrace >"$work/apt.log" 2>&1 ||
  { cat "$work/apt.log"; fail "apt-get purge steptrace"; }
[[ ! -e /usr/bin/steptraced ]] || fail "purge left /usr/bin/steptraced behind"
echo "deb-install-check: installed, verified, served and purged cleanly"
