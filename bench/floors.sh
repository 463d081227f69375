# Sourced by bench/profile.sh and bench/tunnel-ab.sh: the loopback origin
# and the bare relay they measure Palisade against, written once.
#
#   origin_files DIR   nginx serving GET /small (100 bytes) on
#                      127.0.0.1:18080 from DIR (DIR/nginx.conf, run with
#                      `nginx -c DIR/nginx.conf -p DIR/nginx`), and
#                      DIR/hosts naming allowed.bench 127.0.0.1
#   relay_cfg FILE     HAProxy as a bare TCP relay (one thread, no log) on
#                      127.0.0.1:13150 to that origin
#   wait_port PORT     until something listens on 127.0.0.1:PORT (60 s at
#                      most; then says so and returns 1)

origin_files() {
  local dir=$1
  mkdir -p "$dir/www" "$dir/nginx"
  printf 'x%.0s' $(seq 1 100) >"$dir/www/small"
  printf '127.0.0.1 allowed.bench\n' >"$dir/hosts"
  cat >"$dir/nginx.conf" <<CONF
worker_processes 1;
daemon off;
pid $dir/nginx.pid;
error_log $dir/nginx-error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $dir/nginx;
  proxy_temp_path $dir/nginx;
  fastcgi_temp_path $dir/nginx;
  uwsgi_temp_path $dir/nginx;
  scgi_temp_path $dir/nginx;
  server {
    listen 127.0.0.1:18080;
    root $dir/www;
    location = /small { default_type text/plain; }
  }
}
CONF
}

relay_cfg() {
  cat >"$1" <<CONF
global
  maxconn 4096
  nbthread 1
defaults
  mode tcp
  timeout connect 5s
  timeout client 30s
  timeout server 30s
listen relay
  bind 127.0.0.1:13150
  server origin 127.0.0.1:18080
CONF
}

wait_port() {
  for _ in $(seq 1 300); do
    (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.2
  done
  echo "nothing listens on $1" >&2
  return 1
}
