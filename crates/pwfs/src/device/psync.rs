//! pread/pwrite engine: the reference. One system call per op, in order, inside
//! `start` (a handle is finished when it is returned). A FUA write is pwritev2 with
//! RWF_DSYNC (pwritev and fdatasync where the kernel refuses the flag); a flush is
//! fdatasync.

use super::{transferred, validate, DevError, Device, FileMedium, Op, OpKind, Pending};
use std::fs::File;

pub struct PsyncDevice {
    medium: FileMedium,
}

impl PsyncDevice {
    /// Wrap an open file or block device; `len` is its usable size in bytes.
    pub fn new(file: File, len: u64) -> PsyncDevice {
        PsyncDevice::on(FileMedium::new(file, len))
    }

    pub fn on(medium: FileMedium) -> PsyncDevice {
        PsyncDevice { medium }
    }

    fn run(&self, op: &mut Op) -> Result<(), DevError> {
        validate(op, self.medium.len())?;
        let fd = self.medium.fd();
        if op.kind == OpKind::Flush {
            return datasync(fd);
        }
        let iov: Vec<libc::iovec> = op
            .bufs
            .iter_mut()
            .map(|b| libc::iovec { iov_base: b.as_mut_ptr() as *mut libc::c_void, iov_len: b.len() })
            .collect();
        let (ptr, n, at) = (iov.as_ptr(), iov.len() as i32, op.offset as i64);
        let call = || -> Result<isize, DevError> {
            // SAFETY: every iovec points into a live buffer that `op` owns for the call.
            Ok(unsafe {
                match op.kind {
                    OpKind::Read => libc::preadv(fd, ptr, n, at),
                    OpKind::Write => libc::pwritev(fd, ptr, n, at),
                    OpKind::WriteFua => {
                        let r = libc::pwritev2(fd, ptr, n, at, libc::RWF_DSYNC);
                        if r < 0 && matches!(errno(), libc::EOPNOTSUPP | libc::ENOSYS) {
                            let r = libc::pwritev(fd, ptr, n, at);
                            if r >= 0 {
                                datasync(fd)?;
                            }
                            r
                        } else {
                            r
                        }
                    }
                    OpKind::Flush => unreachable!("handled above"),
                }
            })
        };
        // A signal before anything moved (an image on NFS, say) is no I/O error.
        let r = loop {
            let r = call()?;
            if !(r < 0 && errno() == libc::EINTR) {
                break r;
            }
        };
        transferred(if r < 0 { -(errno() as i64) } else { r as i64 }, op.len())
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

fn datasync(fd: i32) -> Result<(), DevError> {
    loop {
        // SAFETY: plain syscall on an fd the medium owns.
        if unsafe { libc::fdatasync(fd) } == 0 {
            return Ok(());
        }
        match errno() {
            libc::EINTR => continue,
            e => return Err(DevError::Io(e)),
        }
    }
}

impl Device for PsyncDevice {
    fn len(&self) -> u64 {
        self.medium.len()
    }

    fn start(&self, ops: Vec<Op>) -> Pending {
        Pending::run_each(ops, |op| self.run(op))
    }

    fn name(&self) -> &'static str {
        "psync"
    }
}
