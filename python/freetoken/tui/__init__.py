"""`ft top`: a live terminal view of a running server, drawn with rich from its stats snapshots.

`view` draws one frame from snapshots (pure, so tests render recorded ones); `app` polls the server, keeps the
last numbers on screen while it is unreachable (a restart), and reads `q` from the keyboard.
"""
