#!/usr/bin/env bash
# Prints one IPv4 address of THIS node that the other nodes of the job can reach (used by
# qarl_multinode.sbatch for torchrun's rendezvous / --local-addr and for the SGLang servers' --host).
# Never a loopback address while another one exists: Debian/Ubuntu images map the hostname to 127.0.1.1,
# and getfqdn() may say `localhost`.
#
# Order:
#   1. QARL_ADDR_IFNAME, else NCCL_SOCKET_IFNAME (an interface name or prefix, e.g. ib0, eth; the first of a
#      comma list; a `^...` exclusion list is skipped): that interface's first IPv4 address;
#   2. the name lookup of the Slurm node name ($SLURMD_NODENAME, else `hostname`): the address the other
#      nodes resolve it to, if it is not loopback;
#   3. the source address of this node's route to the outside (`ip -4 route get 1.1.1.1`; sends nothing);
#   4. the first address `hostname -I` lists;
#   5. whatever step 2 gave (loopback: single-node jobs only), else the node name itself.
set -uo pipefail

is_loopback() { [[ "$1" == 127.* ]]; }

ifname="${QARL_ADDR_IFNAME:-${NCCL_SOCKET_IFNAME:-}}"
ifname="${ifname%%,*}"
ifname="${ifname#=}"
if [ -n "$ifname" ] && [[ "$ifname" != ^* ]]; then
  # `ip -4 -o addr show`: "2: eth0    inet 10.1.2.3/16 brd ... scope global eth0"
  addr="$(ip -4 -o addr show 2>/dev/null | awk -v p="$ifname" \
    'index($2, p) == 1 && $3 == "inet" { sub(/\/.*/, "", $4); print $4; exit }')"
  if [ -n "$addr" ]; then echo "$addr"; exit 0; fi
  echo "node_addr.sh: no IPv4 address on an interface named $ifname*; trying the node name" >&2
fi

name="${SLURMD_NODENAME:-$(hostname)}"
looked_up=""
while read -r a _; do
  [ -n "$a" ] || continue
  [ -n "$looked_up" ] || looked_up="$a"
  if ! is_loopback "$a"; then echo "$a"; exit 0; fi
done < <(getent ahostsv4 "$name" 2>/dev/null)

addr="$(ip -4 route get 1.1.1.1 2>/dev/null |
  awk '{ for (i = 1; i < NF; i++) if ($i == "src") { print $(i + 1); exit } }')"
if [ -n "$addr" ] && ! is_loopback "$addr"; then echo "$addr"; exit 0; fi

for a in $(hostname -I 2>/dev/null); do
  if [[ "$a" == *.* ]] && ! is_loopback "$a"; then echo "$a"; exit 0; fi
done

echo "${looked_up:-$name}"
