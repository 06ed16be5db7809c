"""Run one of the project's scripts on a machine with a fault: a read-only folder, a full disk, or
an optimizer step that leaves NaN in the weights. For tests/test_hostile.py (issue 26).

    python tests/faults.py --read-only DIR [--read-only DIR2 ...] -- ppo.py --out DIR ...
    python tests/faults.py --disk-full DIR --free BYTES -- ppo.py --out DIR ...
    python tests/faults.py --nan-after PATH -- ppo.py ...

Why a launcher and not chmod or a mount: the tests run as root, and root writes through chmod
0555; a real read-only or size-limited tmpfs needs mount privileges (CAP_SYS_ADMIN) that a CI
container may not have. So, before the script starts (runpy, in this same process: its exit
code, its stderr and its signals are the script's own), the functions through which Python and
the libraries the project uses reach the disk are wrapped, for paths under the named folders
only, to fail as the kernel and those libraries do on such a file system. Each failure copies
what a real tmpfs gives (tests/test_hostile.py compares the two where mounting is allowed):

  --read-only DIR   creating, writing, renaming or deleting anything at or under DIR:
                    OSError EROFS from open() in a writing mode, os.open with a writing flag,
                    os.mkdir (FileExistsError first where the path exists, as Linux answers),
                    os.rename / replace / remove / unlink / rmdir / symlink / link / truncate /
                    chmod / utime (shutil.rmtree goes through these); safetensors' save_file
                    raises its SafetensorError and torch.save its RuntimeError, with the messages
                    a read-only tmpfs gives; os.access(W_OK) is False and os.statvfs has ST_RDONLY.
  --disk-full DIR --free BYTES
                    DIR holds at most what it held at the start plus BYTES (the sum of the sizes
                    of the files under it; deleting frees space). A write that does not fit writes
                    what fits and fails: OSError ENOSPC from a Python file's write() or os.write;
                    safetensors' save_file raises SafetensorError "No space left on device (os
                    error 28)" and leaves no file; torch.save leaves a cut file and raises
                    RuntimeError "unexpected pos" (what torch says on a full disk, with no word of
                    space). os.statvfs reports the free space left. Folders and empty files are
                    created as usual.
  --nan-after PATH  the first optimizer step taken once PATH exists (e.g. a run's first
                    checkpoint) sets one element of every parameter its optimizer updates to NaN
                    (torch's public global step hook; any optimizer, however many): a run whose
                    weights became non-finite, which no flag can cause once --lr must be finite.
"""
import builtins
import errno
import io
import os
import runpy
import sys

_open, _io_open, _os_open, _os_write = builtins.open, io.open, os.open, os.write
_access, _statvfs, _mkdir = os.access, os.statvfs, os.mkdir
READ_ONLY, FULL = [], {}  # folders; folder -> capacity in bytes
WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _abs(path, dir_fd=None):
    """The absolute path a call names (a path relative to dir_fd, or an open descriptor)."""
    if isinstance(path, int):
        return os.readlink(f"/proc/self/fd/{path}")
    path = os.fsdecode(os.fspath(path))
    if dir_fd is not None and not os.path.isabs(path):
        path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    return os.path.abspath(path)


def _under(path, folders, dir_fd=None):
    try:
        p = _abs(path, dir_fd)
    except (TypeError, OSError):
        return None
    return next((f for f in folders if p == f or p.startswith(f + os.sep)), None)


def _erofs(path):
    return OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(os.fspath(path)))


def _used(folder):
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _room(folder):
    return max(0, FULL[folder] - _used(folder))


def _enospc():
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _FullFile:
    """A file under a --disk-full folder: each write goes to disk at once (so that the space it
    takes is counted) and fails with ENOSPC, after writing what fits, when the disk is full."""

    def __init__(self, f, folder):
        self._f, self._folder = f, folder

    def write(self, data):
        raw = data.encode(getattr(self._f, "encoding", None) or "utf-8", "replace") \
            if isinstance(data, str) else bytes(data)
        room = _room(self._folder)
        if len(raw) > room:
            if room:
                self._f.write(data[:room])
                self._f.flush()
            raise _enospc()
        n = self._f.write(data)
        self._f.flush()
        return n

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)


def _writing_mode(mode):
    return any(c in mode for c in "wax+")


def open_(file, mode="r", *args, **kwargs):
    if not isinstance(file, int) and _writing_mode(mode):
        if _under(file, READ_ONLY):
            raise _erofs(file)
        folder = _under(file, FULL)
        if folder:
            return _FullFile(_open(file, mode, *args, **kwargs), folder)
    return _open(file, mode, *args, **kwargs)


def os_open(path, flags, mode=0o777, *, dir_fd=None):
    if flags & WRITING and _under(path, READ_ONLY, dir_fd):
        if not flags & os.O_CREAT and not os.path.lexists(_abs(path, dir_fd)):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        raise _erofs(path)
    return _os_open(path, flags, mode, dir_fd=dir_fd)


def os_write(fd, data):
    folder = _under(fd, FULL) if FULL else None
    if folder and len(data) > _room(folder):
        room = _room(folder)
        if room:
            _os_write(fd, bytes(data[:room]))
        raise _enospc()
    return _os_write(fd, data)


def mkdir(path, mode=0o777, *, dir_fd=None):
    if _under(path, READ_ONLY, dir_fd):
        if os.path.lexists(_abs(path, dir_fd)):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
        raise _erofs(path)
    return _mkdir(path, mode, dir_fd=dir_fd)


# os functions that change a folder: (argument index, its dir_fd keyword) of each path they change
MOVES = ((0, "src_dir_fd"), (1, "dst_dir_fd"))
CHANGES = {"rename": MOVES, "replace": MOVES,
           "link": ((1, "dst_dir_fd"),), "symlink": ((1, "dir_fd"),), "remove": ((0, "dir_fd"),),
           "unlink": ((0, "dir_fd"),), "rmdir": ((0, "dir_fd"),), "truncate": ((0, None),),
           "chmod": ((0, "dir_fd"),), "utime": ((0, "dir_fd"),)}


def _refuse_under_read_only(name):
    """os.NAME raises EROFS when a path it would change lies under a read-only folder."""
    original = getattr(os, name)

    def wrapped(*args, **kwargs):
        for i, fd in CHANGES[name]:
            if i < len(args) and _under(args[i], READ_ONLY, kwargs.get(fd) if fd else None):
                raise _erofs(args[i])
        return original(*args, **kwargs)
    setattr(os, name, wrapped)


def access(path, mode, **kwargs):
    if mode & os.W_OK and _under(path, READ_ONLY, kwargs.get("dir_fd")):
        return False
    return _access(path, mode, **kwargs)


def statvfs(path):
    real = _statvfs(path)
    fields = list(real)
    if _under(path, READ_ONLY):
        fields[8] |= os.ST_RDONLY
    folder = _under(path, FULL)
    if folder:
        size = real.f_frsize or 4096
        fields[2] = FULL[folder] // size               # f_blocks
        fields[3] = fields[4] = _room(folder) // size  # f_bfree, f_bavail
    return os.statvfs_result(fields)


def patch_libraries():
    """safetensors' save_file and torch.save write from native code, not through Python's open."""
    import safetensors.torch
    import torch
    from safetensors import SafetensorError

    save_file, torch_save = safetensors.torch.save_file, torch.save

    def save_file_(tensors, filename, metadata=None):
        folder = _under(filename, READ_ONLY)
        if folder:
            raise SafetensorError(f"Error while serializing: I/O error: Read-only file system (os error 30) "
                                  f"at path \"{os.path.dirname(_abs(filename))}/.tmpX1f3zQ\"")
        folder = _under(filename, FULL)
        if folder and len(safetensors.torch.save(tensors, metadata)) > _room(folder):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return save_file(tensors, filename, metadata)

    def torch_save_(obj, f, *args, **kwargs):
        if isinstance(f, (str, bytes, os.PathLike)):
            if _under(f, READ_ONLY):
                raise RuntimeError("[enforce fail at inline_container.cc:747] . open file failed with "
                                   "strerror: Read-only file system")
            folder = _under(f, FULL)
            if folder:
                buffer = io.BytesIO()
                torch_save(obj, buffer, *args, **kwargs)
                data, room = buffer.getvalue(), _room(folder)
                with _open(f, "wb") as out:
                    out.write(data[:room])
                if len(data) > room:
                    raise RuntimeError(f"[enforce fail at inline_container.cc:672] . unexpected pos {room} "
                                       f"vs {len(data)}")
                return None
        return torch_save(obj, f, *args, **kwargs)

    safetensors.torch.save_file, torch.save = save_file_, torch_save_


def nan_after(path):
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    done = []

    def hook(optimizer, args, kwargs):
        if not done and os.path.exists(path):
            done.append(True)
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p[(0,) * p.dim()] = float("nan")
    register_optimizer_step_post_hook(hook)


def main(argv):
    if "--" not in argv:
        sys.exit("usage: faults.py [--read-only DIR] [--disk-full DIR --free BYTES] [--nan-after PATH] "
                 "-- SCRIPT ARGS")
    own, (script, *args) = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    full, poison = None, None
    while own:
        flag, value, own = own[0], own[1], own[2:]
        if flag == "--read-only":
            READ_ONLY.append(os.path.abspath(value))
        elif flag == "--disk-full":
            full = os.path.abspath(value)
        elif flag == "--free":
            FULL[full] = _used(full) + int(value)
        elif flag == "--nan-after":
            poison = os.path.abspath(value)
        else:
            sys.exit(f"faults.py: unknown flag {flag}")
    builtins.open = io.open = open_
    os.open, os.write, os.mkdir, os.access, os.statvfs = os_open, os_write, mkdir, access, statvfs
    for name in CHANGES:
        _refuse_under_read_only(name)
    patch_libraries()
    if poison:
        nan_after(poison)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` has it, not tests/
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
