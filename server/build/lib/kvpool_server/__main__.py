"""``python -m kvpool_server``: the same as the ``kvpool-server`` console script."""

from kvpool_server.main import main

main()
