#!/bin/sh
# Remove the mlx-sidecar launchd service installed by install.sh (state and logs are kept
# unless --purge is given).
set -eu

label=com.mlx-sidecar
system=0 dry_run=0 purge=0

. "$(dirname "$0")/common.sh"

while [ $# -gt 0 ]; do
	case $1 in
	--system) system=1 ;;
	--purge) purge=1 ;;
	--dry-run) dry_run=1 ;;
	-h | --help)
		echo "usage: $0 [--system] [--purge (also delete the state dir, token and logs)] [--dry-run]"
		exit 0 ;;
	*) die "unknown option: $1 (see --help)" ;;
	esac
	shift
done

if [ "$system" = 1 ]; then
	domain=system
	plist=/Library/LaunchDaemons/$label.plist
	home_dir="/Library/Application Support/mlx-sidecar"
	log_dir=/Library/Logs/mlx-sidecar
	[ "$dry_run" = 1 ] || [ "$(id -u)" = 0 ] || die "--system must run as root (sudo)"
else
	[ -n "${HOME:-}" ] || die "HOME is not set"
	domain=gui/$(id -u)
	plist=$HOME/Library/LaunchAgents/$label.plist
	home_dir="$HOME/Library/Application Support/mlx-sidecar"
	log_dir=$HOME/Library/Logs/mlx-sidecar
fi

# bootout sends SIGTERM and waits up to ExitTimeOut for the drain; "not loaded" is fine.
run launchctl bootout "$domain/$label" 2>/dev/null || true
run rm -f "$plist"
if [ "$purge" = 1 ]; then
	run rm -rf "$home_dir" "$log_dir"
elif [ "$dry_run" = 0 ]; then
	echo "mlx-sidecar: removed $plist; kept $home_dir and $log_dir (--purge deletes them)" >&2
fi
