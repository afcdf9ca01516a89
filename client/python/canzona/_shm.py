"""POSIX shared memory the daemon maps, with the standard library only.

The same protocol as proto/shared_memory/shared_memory.{h,cc} (the C++ side both the
daemon and the C++ client link): objects are named
"/canzona.<job>.<rank>.<seq>" (job: [A-Za-z0-9_-]{1,64}; rank, seq:
digits), created with O_CREAT | O_EXCL and mode 0600, sized with ftruncate
(zero-filled), every page backed with posix_fallocate (a /dev/shm too small
for it is RESOURCE_EXHAUSTED here, not a SIGBUS at the first write past its
limit) and mapped read-write; the creator unlinks the name when its
handle goes away. shm_open(3) on Linux is open(2) under /dev/shm, which is
what this module calls.

Why not multiprocessing.shared_memory: its resource tracker (a helper
process per trainer) would unlink at exit too, but it also warns about
"leaked" objects at every shutdown, and on Python < 3.13 it cannot be told
to leave an object alone; and it has its own naming rules. Unlinking here
follows the C++ handle: close(), garbage collection or interpreter exit
(weakref.finalize). A trainer killed with SIGKILL cannot: the daemon
removes the names of the objects it had mapped once it sees the trainer
exit (SharedMemory::RemoveNameIfOurs); objects it never mapped stay.

Thread-safety: a SharedBuffer is plain memory; who writes it when is the
step protocol's business.
"""

import errno
import mmap
import os
import re
import threading
import weakref

from canzona._errors import CanzonaError

SHM_DIR = "/dev/shm"
_PREFIX = "/canzona."
_JOB = re.compile(r"[A-Za-z0-9_-]+")

# What proto/shared_memory's Reserve says too.
_SMALL_SHM_REMEDY = (
    "a container's /dev/shm is small unless sized: docker run --shm-size, "
    "or a Memory-medium emptyDir mounted at /dev/shm in Kubernetes")

# errno -> status code, as proto/shared_memory's ErrnoStatus maps them.
_ERRNO_CODES = {
    errno.ENOENT: "NOT_FOUND",
    errno.EEXIST: "ALREADY_EXISTS",
    errno.EACCES: "PERMISSION_DENIED",
    errno.EPERM: "PERMISSION_DENIED",
    errno.ENOMEM: "RESOURCE_EXHAUSTED",
    errno.ENOSPC: "RESOURCE_EXHAUSTED",
    errno.EMFILE: "RESOURCE_EXHAUSTED",
    errno.ENFILE: "RESOURCE_EXHAUSTED",
}


def shm_name(job_id, rank, seq):
    """The documented name of a job's rank's seq-th buffer object."""
    return "%s%s.%d.%d" % (_PREFIX, job_id, rank, seq)


# next_shm_seq's state: (pid it was drawn for, nonce, objects named).
_seq_state = [0, 0, 0]
_seq_lock = threading.Lock()
_SEQ_NONCES, _SEQS_PER_PROCESS = 10**9, 10**6


def next_shm_seq():
    """The seq for this process's next object, as proto/shared_memory's
    NextShmSeq: a random number drawn once per process (again in a forked
    child) times 10^6, plus how many it named before. A trainer restarted
    on the same job id and rank (torchrun's restarts, a requeued job) never
    meets a name its killed predecessor left in /dev/shm."""
    with _seq_lock:
        pid = os.getpid()
        if _seq_state[0] != pid:
            nonce = 1 + int.from_bytes(os.urandom(8), "little") % (
                _SEQ_NONCES - 1)
            _seq_state[:] = [pid, nonce, 0]
        _, nonce, named = _seq_state
        _seq_state[2] = named + 1
        return nonce * _SEQS_PER_PROCESS + named % _SEQS_PER_PROCESS


def _digits(text):
    return 0 < len(text) <= 18 and text.isascii() and text.isdigit()


def validate_shm_name(name):
    """Raises CanzonaError INVALID_ARGUMENT naming the problem unless
    ``name`` matches /canzona.<job>.<rank>.<seq>."""

    def invalid(why):
        return CanzonaError('shm name "%s": %s (expected '
                            '/canzona.<job>.<rank>.<seq>)' % (name, why),
                            "INVALID_ARGUMENT")

    if not name.startswith(_PREFIX):
        raise invalid("wrong prefix")
    parts = name[len(_PREFIX):].split(".")
    if len(parts) != 3:
        raise invalid("wrong number of fields")
    job, rank, seq = parts
    if not 1 <= len(job) <= 64:
        raise invalid("job id must have 1 to 64 characters")
    if not (job.isascii() and _JOB.fullmatch(job)):
        raise invalid("job id may hold only letters, digits, '_' and '-'")
    if not (_digits(rank) and _digits(seq)):
        raise invalid("rank and seq must be decimal numbers")


def _errno_error(what, name, err):
    return CanzonaError("%s %s: %s" % (what, name, os.strerror(err)),
                        _ERRNO_CODES.get(err, "INTERNAL"))


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SharedBuffer(mmap.mmap):
    """A new zero-filled shared-memory object, mapped read-write (an mmap:
    the buffer protocol, so torch.frombuffer views it without a copy).
    ``name`` is what a BufferRef names; the name is unlinked on close(),
    when the buffer is garbage-collected, or at interpreter exit."""

    @classmethod
    def create(cls, name, nbytes):
        """ALREADY_EXISTS if the name is taken; INVALID_ARGUMENT for a bad
        name or size."""
        validate_shm_name(name)
        if nbytes <= 0:
            raise CanzonaError("shm %s: size must be > 0" % name,
                               "INVALID_ARGUMENT")
        path = SHM_DIR + name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL |
                         os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise _errno_error("shm_open", name, e.errno) from None
        try:
            # From here on, failure unlinks the name.
            try:
                os.ftruncate(fd, nbytes)
            except OSError as e:
                raise _errno_error("ftruncate", name, e.errno) from None
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                error = _errno_error("posix_fallocate", name, e.errno)
                if e.errno == errno.ENOSPC:
                    error = CanzonaError(
                        "%s: /dev/shm cannot hold these %d bytes (%s)"
                        % (error, nbytes, _SMALL_SHM_REMEDY), error.code)
                raise error from None
            try:
                buffer = super().__new__(cls, fd, nbytes, mmap.MAP_SHARED,
                                         mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:
                raise _errno_error("mmap", name, e.errno) from None
        except BaseException:
            _unlink(path)
            raise
        finally:
            os.close(fd)
        buffer._name = name
        buffer._nbytes = nbytes
        buffer._unlinker = weakref.finalize(buffer, _unlink, path)
        return buffer

    @property
    def name(self):
        return self._name

    @property
    def nbytes(self):
        return self._nbytes

    def unlink(self):
        """Removes the name now (the mapping stays valid)."""
        self._unlinker()

    def close(self):
        """Unlinks the name and unmaps (BufferError while tensors still view
        the memory; the name is gone either way)."""
        self._unlinker()
        super().close()
