"""The status page of `fleet serve` (app.py) and the files it serves: index.html, login.html, plain
JS modules and CSS, shipped in the wheel beside this module."""
