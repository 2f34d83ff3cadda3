"""aadet's tests, one folder per package of ``aadet`` (``tests/layers`` tests ``aadet/layers``, ...),
``tests/tools`` for the command-line tools, ``tests/project`` for repo-wide checks and
``tests/helpers`` for the code they share. The folders are packages, so tests import the helpers
as ``tests.helpers`` (``pythonpath = .`` in pytest.ini)."""
