# Shared by install.sh and uninstall.sh (sourced).
die() { printf '%s: %s\n' "${0##*/}" "$*" >&2; exit 1; }
show() { # print a command, shell-quoted
	out=+
	for a in "$@"; do
		case $a in *[!A-Za-z0-9_./:=@%+-]* | '') a="'$(printf '%s' "$a" | sed "s/'/'\\\\''/g")'" ;; esac
		out="$out $a"
	done
	printf '%s\n' "$out"
}
run() { if [ "$dry_run" = 1 ]; then show "$@"; else "$@"; fi; }
