"""``python -m kvtier`` prints the version and the default socket."""

import kvtier

print(f"kvtier {kvtier.__version__}; socket {kvtier.default_socket()}")
