"""Running pyklei across machines: Ray (the `ray` extra; pip install -e '.[ray]').

    ray_util.py   import Ray or say which extra is missing; connect to a cluster, or start a
                  local one, with one clear line when it cannot be reached (never a hang)
"""
