"""Reference clients of the public HTTP API (each one a static page the server can also host)."""
