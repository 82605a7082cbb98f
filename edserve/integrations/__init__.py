"""Deployments of edserve on other runtimes (Ray Serve: :mod:`edserve.integrations.ray_serve`,
``pip install 'edserve[ray]'``)."""
