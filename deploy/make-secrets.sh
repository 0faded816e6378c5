#!/bin/sh
# make-secrets.sh DIR: the mesh's credentials for a deployment, written once into DIR
# (git-ignored under deploy/): Redis passwords of the gateway and router ACL users
# (redis-users/), the Redis URL each service reads, with its user and password, over TLS
# (<service>-redis-url, and <service>.env for compose), and the admin API's token (admin-token;
# the admin gateway's side, its SHA-256, in admin-token-sha256 and admin.env). Passwords and the
# token that exist are kept, so a second run changes nothing; delete one (redis-users/gateway,
# admin-token...) and run again to rotate it: what derives from it is written again.
# Docs: docs/DEPLOYING.md.
set -eu
dir=$1
umask 077
mkdir -p "$dir/redis-users"
random() { od -An -N32 -tx1 /dev/urandom | tr -d ' \n'; }
keep() { [ -s "$1" ] || { cat >"$1.tmp" && mv "$1.tmp" "$1"; }; }
for user in gateway router; do
  random | keep "$dir/redis-users/$user"
  # The CA is the one the services' certificates come from (the [tls] ca_file): Redis's
  # certificate must name the host "redis".
  password=$(cat "$dir/redis-users/$user")
  url="rediss://$user:$password@redis:6379/0?ssl_ca_certs=/etc/infermesh-tls/ca.crt"
  printf %s "$url" >"$dir/$user-redis-url"
  echo "$(echo "INFERMESH_${user}_REDIS_URL" | tr a-z A-Z)=$url" >"$dir/$user.env"
done
# The admin token stays with the operator (admin-token, for `python -m infermesh keys`); the
# admin gateway holds only its SHA-256 ([admin] token_sha256).
random | keep "$dir/admin-token"
digest=$(printf %s "$(cat "$dir/admin-token")" | sha256sum | cut -d' ' -f1)
printf %s "$digest" >"$dir/admin-token-sha256"
echo "INFERMESH_GATEWAY_ADMIN_TOKEN_SHA256=$digest" >"$dir/admin.env"
