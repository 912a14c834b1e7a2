"""docs/dashboard.md's "Behind Django's login" recipe, run as written.

The recipe's ``asgi.py`` is cut from the docs, put in a throwaway Django
project (SQLite for Django's users and sessions, the test's PostgreSQL for
Conveyor) and driven in a child process, because Django can be set up only
once per process and tests/contrib/test_django.py sets up another project.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "dashboard.md"

SETTINGS = '''
SECRET_KEY = "recipe-test"
INSTALLED_APPS = ["django.contrib.auth", "django.contrib.contenttypes", "django.contrib.sessions"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "%(sqlite)s"}}
USE_TZ = True
ROOT_URLCONF = "mysite.urls"
ALLOWED_HOSTS = ["*"]
'''

DRIVER = '''
import asyncio, json
import httpx

from mysite.asgi import application, dashboard  # sets Django up, as under uvicorn

from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client

call_command("migrate", verbosity=0)
cookies = {}
for name, staff, superuser in (("viewer", True, False), ("admin", True, True),
                               ("customer", False, False)):
    user = User.objects.create_user(name, password="x", is_staff=staff, is_superuser=superuser)
    client = Client()
    client.force_login(user)
    cookies[name] = client.cookies["sessionid"].value

async def main():
    answers = {}
    transport = httpx.ASGITransport(app=application)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        for who in ("anonymous", "customer", "viewer", "admin"):
            jar = {"sessionid": cookies[who]} if who in cookies else {}
            page = await http.get("/ops/queue/", cookies=jar)
            answers[who + " GET"] = page.status_code
            token = page.cookies.get("conveyor_csrf") or "x" * 43
            posted = await http.post("/ops/queue/pauses", data={"csrf_token": token,
                                     "pattern": who + ".*"},
                                     cookies={**jar, "conveyor_csrf": token})
            answers[who + " POST"] = posted.status_code
        answers["django"] = (await http.get("/hello")).text
    await dashboard.state.conveyor_dashboard.close()
    print(json.dumps(answers))

asyncio.run(main())
'''


def _recipe() -> str:
    text = DOCS.read_text()
    found = re.search(r"<!-- django-recipe -->\n```python\n(.*?)```", text, re.S)
    assert found is not None, "docs/dashboard.md lost its Django recipe"
    return found.group(1)


def test_the_django_recipe_lets_staff_look_superusers_act_and_nobody_else(fresh_db: str,
                                                                          tmp_path: Path) -> None:
    site = tmp_path / "mysite"
    site.mkdir()
    (site / "__init__.py").write_text("")
    (site / "settings.py").write_text(SETTINGS % {"sqlite": tmp_path / "django.sqlite3"})
    (site / "urls.py").write_text(
        "from django.http import HttpResponse\nfrom django.urls import path\n"
        "urlpatterns = [path('hello', lambda request: HttpResponse('hello from django'))]\n")
    (site / "asgi.py").write_text(_recipe())
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CONVEYOR_") and k != "DJANGO_SETTINGS_MODULE"}
    env.update(DATABASE_URL=fresh_db, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO / "src")]))
    done = subprocess.run([sys.executable, "driver.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    assert answers == {
        "anonymous GET": 403, "anonymous POST": 403,
        "customer GET": 403, "customer POST": 403,
        "viewer GET": 200, "viewer POST": 403,
        "admin GET": 200, "admin POST": 303,
        "django": "hello from django",
    }
