//! pread/pwrite engine: the reference. One system call per op, in order.

use super::{validate, DevError, Device, Done, Op, OpKind};
use std::fs::File;
use std::os::unix::io::AsRawFd;

pub struct PsyncDevice {
    file: File,
    len: u64,
}

impl PsyncDevice {
    /// Wrap an open file or block device; `len` is its usable size in bytes.
    pub fn new(file: File, len: u64) -> PsyncDevice {
        PsyncDevice { file, len: len - len % super::SECTOR }
    }

    fn run(&self, op: &mut Op) -> Result<(), DevError> {
        validate(op, self.len)?;
        let iov: Vec<libc::iovec> = op
            .bufs
            .iter_mut()
            .map(|b| libc::iovec { iov_base: b.as_mut_ptr() as *mut libc::c_void, iov_len: b.len() })
            .collect();
        let fd = self.file.as_raw_fd();
        // SAFETY: every iovec points into a live buffer that `op` owns for the call.
        let n = unsafe {
            match op.kind {
                OpKind::Read => libc::preadv(fd, iov.as_ptr(), iov.len() as i32, op.offset as i64),
                OpKind::Write => libc::pwritev(fd, iov.as_ptr(), iov.len() as i32, op.offset as i64),
            }
        };
        complete(n as i64, op.len())
    }
}

/// Turn a byte count or negative errno-style result into the device result.
pub(crate) fn complete(n: i64, expected: u64) -> Result<(), DevError> {
    if n < 0 {
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
        return Err(DevError::Io(errno));
    }
    if n as u64 != expected {
        return Err(DevError::Short { expected, got: n as u64 });
    }
    Ok(())
}

impl Device for PsyncDevice {
    fn len(&self) -> u64 {
        self.len
    }

    fn submit(&self, ops: Vec<Op>) -> Vec<Done> {
        ops.into_iter()
            .map(|mut op| {
                let result = self.run(&mut op);
                Done { bufs: op.bufs, result }
            })
            .collect()
    }

    fn flush(&self) -> Result<(), DevError> {
        // SAFETY: plain syscall on an fd we own.
        let r = unsafe { libc::fdatasync(self.file.as_raw_fd()) };
        if r != 0 {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
            return Err(DevError::Io(errno));
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "psync"
    }
}
