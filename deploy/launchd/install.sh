#!/bin/sh
# Install mlx-sidecar as a launchd service on macOS: renders com.mlx-sidecar.plist, validates it,
# writes it to ~/Library/LaunchAgents (or /Library/LaunchDaemons with --system) and (re)loads it.
set -eu

label=com.mlx-sidecar
template=$(cd "$(dirname "$0")" && pwd)/$label.plist
model=builtin:small port=8000 token_file= program= system=0 user= dry_run=0
rank= hostfile= tp=1 pp=1 backend=ring
nl='
'

usage() {
	cat <<USAGE
usage: $0 [--model M] [--port N] [--token-file F] [--program P] [--system [--user U]] [--dry-run]
          [--rank R --hostfile F (--tensor-parallel N | --pipeline-parallel N) [--backend B]]
  --model M       model to preload (default: $model)
  --port N        TCP port on 127.0.0.1 (default: $port)
  --token-file F  bearer-token file (absolute); default: <state dir>/token, generated (0600) if missing
  --program P     the mlx-sidecar executable (default: command -v mlx-sidecar)
  --system        a LaunchDaemon in /Library/LaunchDaemons (run with sudo) instead of a LaunchAgent
  --user U        the account the LaunchDaemon runs as (default: \$SUDO_USER; never root)
  --dry-run       print the rendered plist and the commands instead of running them
 one rank of a group serving one model over several Macs (docs/scale-out.md), one per Mac:
  --rank R        this Mac's rank (0 serves HTTP; the others follow it)
  --hostfile F    the mx.distributed hostfile (absolute; the same file on every Mac)
  --tensor-parallel N / --pipeline-parallel N   ranks in the group (N lines in the hostfile)
  --backend B     ring (TCP; the only one set up by a hostfile alone: use mlx.launch for jaccl)
USAGE
}
. "$(dirname "$0")/common.sh"

while [ $# -gt 0 ]; do
	case $1 in
	--model | --port | --token-file | --program | --user | --rank | --hostfile | --tensor-parallel | --pipeline-parallel | --backend)
		[ $# -ge 2 ] || die "$1 needs a value"
		case $1 in
		--model) model=$2 ;; --port) port=$2 ;; --token-file) token_file=$2 ;;
		--program) program=$2 ;; --user) user=$2 ;;
		--rank) rank=$2 ;; --hostfile) hostfile=$2 ;; --tensor-parallel) tp=$2 ;;
		--pipeline-parallel) pp=$2 ;; --backend) backend=$2 ;;
		esac
		shift 2 ;;
	--system) system=1; shift ;;
	--dry-run) dry_run=1; shift ;;
	-h | --help) usage; exit 0 ;;
	*) die "unknown option: $1 (see --help)" ;;
	esac
done

case $port in '' | *[!0-9]*) die "--port must be a number, got '$port'" ;; esac
[ "$port" -ge 1 ] && [ "$port" -le 65535 ] || die "--port must be in 1..65535, got $port"
[ -n "$model" ] || die "--model must not be empty"
for n in "$tp" "$pp"; do case $n in '' | *[!0-9]* | 0) die "--tensor-parallel/--pipeline-parallel must be >= 1, got '$n'" ;; esac; done
# Only ring is configured by MLX_RANK + MLX_HOSTFILE alone; jaccl and mpi need the variables
# mlx.launch sets for them (start those groups with mlx.launch, see docs/scale-out.md).
case $backend in ring) ;; *) die "--backend must be ring (for jaccl or mpi use mlx.launch), got '$backend'" ;; esac
if [ -n "$rank$hostfile" ] || [ "$tp" != 1 ] || [ "$pp" != 1 ]; then
	[ "$tp" = 1 ] || [ "$pp" = 1 ] || die "--tensor-parallel and --pipeline-parallel cannot be combined"
	[ "$tp$pp" != 11 ] || die "a group rank needs --tensor-parallel N or --pipeline-parallel N (N >= 2)"
	case $rank in '' | *[!0-9]*) die "--rank must be a number, got '$rank'" ;; esac
	[ "$rank" -lt $((tp * pp)) ] || die "--rank must be below the group size $((tp * pp)), got $rank"
	case $hostfile in /*) ;; *) die "--hostfile must be an absolute path, got '$hostfile'" ;; esac
	[ "$dry_run" = 1 ] || [ -s "$hostfile" ] || die "hostfile missing or empty: $hostfile"
fi
[ -n "$program" ] || program=$(command -v mlx-sidecar || true)
[ -n "$program" ] || die "mlx-sidecar is not on PATH; pass --program /absolute/path/to/mlx-sidecar"
case $program in /*) ;; *) die "--program must be an absolute path, got '$program'" ;; esac
[ "$dry_run" = 1 ] || [ -x "$program" ] || die "not executable: $program"

if [ "$system" = 1 ]; then
	domain=system
	plist_dir=/Library/LaunchDaemons
	home_dir="/Library/Application Support/mlx-sidecar"
	log_dir=/Library/Logs/mlx-sidecar
	[ -n "$user" ] || user=${SUDO_USER:-}
	[ -n "$user" ] && [ "$user" != root ] || die "--system needs --user NAME: the daemon must not run as root"
	[ "$dry_run" = 1 ] || [ "$(id -u)" = 0 ] || die "--system must run as root (sudo)"
else
	[ -z "$user" ] || die "--user only applies with --system"
	[ -n "${HOME:-}" ] || die "HOME is not set"
	domain=gui/$(id -u)
	plist_dir=$HOME/Library/LaunchAgents
	home_dir="$HOME/Library/Application Support/mlx-sidecar"
	log_dir=$HOME/Library/Logs/mlx-sidecar
	user=$(id -un)
fi
plist=$plist_dir/$label.plist

new_token=0
if [ -z "$token_file" ]; then
	token_file=$home_dir/token
	[ -s "$token_file" ] || new_token=1
else
	case $token_file in /*) ;; *) die "--token-file must be an absolute path, got '$token_file'" ;; esac
	[ "$dry_run" = 1 ] || [ -s "$token_file" ] || die "token file missing or empty: $token_file"
fi

path="$(dirname "$program"):/opt/homebrew/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
for v in "$program" "$model" "$token_file" "$home_dir" "$log_dir" "$user" "$hostfile"; do
	case $v in *"$nl"*) die "values must not contain newlines" ;; esac
	if printf '%s' "$v" | grep -q '__[A-Z_]*__'; then die "value looks like a template placeholder: $v"; fi
done

# Render: XML-escape each value, then escape it for a sed replacement.
tmp=$(mktemp "${TMPDIR:-/tmp}/mlx-sidecar.XXXXXX")
trap 'rm -f "$tmp" "$tmp.sed" "$tmp.env" "$tmp.group"' EXIT
trap 'exit 1' HUP INT TERM
sub() {
	v=$(printf '%s' "$2" | sed -e 's/&/\&amp;/g' -e 's/</\&lt;/g' -e 's/>/\&gt;/g' -e 's/[\\|&]/\\&/g')
	printf 's|%s|%s|g\n' "$1" "$v"
}
{
	sub __PROGRAM__ "$program"; sub __MODEL__ "$model"; sub __PORT__ "$port"
	sub __TOKEN_FILE__ "$token_file"; sub __HOME__ "$home_dir"; sub __LOG_DIR__ "$log_dir"
	sub __USER__ "$user"; sub __PATH__ "$path"
} >"$tmp.sed"
sed -f "$tmp.sed" "$template" >"$tmp"
if [ -n "$rank" ]; then
	# A group rank: what mlx.launch would export (MLX_RANK, MLX_HOSTFILE) plus the group's shape,
	# as environment entries before MLX_SIDECAR_HOME (every Config field is an MLX_SIDECAR_* variable).
	esc() { printf '%s' "$1" | sed -e 's/&/\&amp;/g' -e 's/</\&lt;/g' -e 's/>/\&gt;/g'; }
	{
		for kv in "MLX_RANK=$rank" "MLX_HOSTFILE=$(esc "$hostfile")" "MLX_SIDECAR_TENSOR_PARALLEL=$tp" \
			"MLX_SIDECAR_PIPELINE_PARALLEL=$pp" "MLX_SIDECAR_DISTRIBUTED_BACKEND=$backend"; do
			printf '\t\t<key>%s</key>\n\t\t<string>%s</string>\n' "${kv%%=*}" "${kv#*=}"
		done
	} >"$tmp.env"
	awk -v envfile="$tmp.env" '/<key>MLX_SIDECAR_HOME<\/key>/ { while ((getline line < envfile) > 0) print line } { print }' \
		"$tmp" >"$tmp.group" && mv "$tmp.group" "$tmp"
fi
if grep -n '__[A-Z_]*__' "$tmp" >&2; then die "unsubstituted placeholders in the rendered plist"; fi
if command -v plutil >/dev/null 2>&1; then
	plutil -lint "$tmp" >/dev/null || die "plutil -lint rejected the rendered plist"
fi
[ "$dry_run" = 0 ] || cat "$tmp" # the plist first, then the commands

run mkdir -p "$plist_dir" "$log_dir"
run mkdir -p -m 0700 "$home_dir"
[ "$system" = 0 ] || run chown "$user" "$home_dir" "$log_dir"
if [ "$new_token" = 1 ]; then
	if [ "$dry_run" = 1 ]; then
		show generate-token "$token_file"
	else
		(umask 077 && printf '%s\n' "$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')" >"$token_file")
		chmod 0600 "$token_file"
		[ "$system" = 0 ] || chown "$user" "$token_file"
	fi
fi
if [ "$system" = 1 ]; then
	run install -m 0644 -o root -g wheel "$tmp" "$plist"
else
	run install -m 0644 "$tmp" "$plist"
fi
run launchctl bootout "$domain/$label" 2>/dev/null || true # not loaded yet: fine
run launchctl enable "$domain/$label"
run launchctl bootstrap "$domain" "$plist"
run launchctl kickstart "$domain/$label" # RunAtLoad already started it; this only makes sure

[ "$dry_run" = 0 ] || exit 0
flag=; [ "$system" = 0 ] || flag=" --system"
cat >&2 <<DONE
mlx-sidecar: $plist ($domain/$label)
  token: $token_file   logs: $log_dir   state: $home_dir
  ready: curl -fsS http://127.0.0.1:$port/readyz
  restart: launchctl kickstart -k $domain/$label   remove: $(dirname "$0")/uninstall.sh$flag
DONE
