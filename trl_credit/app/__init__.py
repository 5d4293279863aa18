"""The application around the host's core: the ``trl-credit`` CLI and its commands, the embedded
offline model, the built-in ``arithmetic`` task (data, rewards, step checker) and held-out evaluation.

The core (``trl_credit.*`` outside this package) never imports from here; plugins import neither.
"""
