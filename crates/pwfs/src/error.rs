//! Errors of the engine.
//!
//! Three kinds are kept apart: corruption found on the medium ([`ErrorKind::Corrupt`],
//! carrying the [`FormatError`]), operating errors (the POSIX conditions, mapped to an
//! errno only by [`Error::errno`] at the front ends), and bugs, which are assertions.

use crate::device::DevError;
use crate::format::FormatError;
use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    NotFound,
    Exists,
    NotDir,
    IsDir,
    NotEmpty,
    NameTooLong,
    NoSpace,
    Io,
    Invalid,
    ReadOnly,
    Loop,
    TooManyLinks,
    FileTooBig,
    BadHandle,
    Corrupt,
    CrossDevice,
    Busy,
    NotPermitted,
    NotSupported,
    NoData,
    Range,
    /// The operation does not apply to this kind of file (fallocate of a FIFO).
    NoDevice,
    /// An offset past the data (SEEK_DATA/SEEK_HOLE at or past the end of the file).
    NoSuchAddress,
    /// E2BIG: an attribute value larger than the largest (64 KiB).
    TooBig,
    /// EACCES: a default ACL on a non-directory.
    AccessDenied,
    /// ENOMEM: a whole-file read larger than memory.
    NoMemory,
    /// ESPIPE: fallocate of a FIFO.
    IllegalSeek,
}

#[derive(Debug, Clone)]
pub struct Error {
    pub kind: ErrorKind,
    pub detail: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(kind: ErrorKind, detail: impl Into<String>) -> Error {
        Error { kind, detail: detail.into() }
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The errno a POSIX front end reports for this error.
    pub fn errno(&self) -> i32 {
        match self.kind {
            ErrorKind::NotFound => libc::ENOENT,
            ErrorKind::Exists => libc::EEXIST,
            ErrorKind::NotDir => libc::ENOTDIR,
            ErrorKind::IsDir => libc::EISDIR,
            ErrorKind::NotEmpty => libc::ENOTEMPTY,
            ErrorKind::NameTooLong => libc::ENAMETOOLONG,
            ErrorKind::NoSpace => libc::ENOSPC,
            ErrorKind::Io | ErrorKind::Corrupt => libc::EIO,
            ErrorKind::Invalid => libc::EINVAL,
            ErrorKind::ReadOnly => libc::EROFS,
            ErrorKind::Loop => libc::ELOOP,
            ErrorKind::TooManyLinks => libc::EMLINK,
            ErrorKind::FileTooBig => libc::EFBIG,
            ErrorKind::BadHandle => libc::EBADF,
            ErrorKind::CrossDevice => libc::EXDEV,
            ErrorKind::Busy => libc::EBUSY,
            ErrorKind::NotPermitted => libc::EPERM,
            ErrorKind::NotSupported => libc::EOPNOTSUPP,
            ErrorKind::NoData => libc::ENODATA,
            ErrorKind::Range => libc::ERANGE,
            ErrorKind::NoDevice => libc::ENODEV,
            ErrorKind::NoSuchAddress => libc::ENXIO,
            ErrorKind::AccessDenied => libc::EACCES,
            ErrorKind::TooBig => libc::E2BIG,
            ErrorKind::NoMemory => libc::ENOMEM,
            ErrorKind::IllegalSeek => libc::ESPIPE,
        }
    }
}

macro_rules! ctor {
    ($($name:ident => $kind:ident),* $(,)?) => {
        impl Error {
            $(pub fn $name(detail: impl Into<String>) -> Error { Error::new(ErrorKind::$kind, detail) })*
        }
    };
}

ctor! {
    not_found => NotFound, exists => Exists, not_dir => NotDir, is_dir => IsDir,
    not_empty => NotEmpty, name_too_long => NameTooLong, no_space => NoSpace, io => Io,
    invalid => Invalid, read_only => ReadOnly, corrupt => Corrupt, not_permitted => NotPermitted,
    too_many_links => TooManyLinks, file_too_big => FileTooBig, is_loop => Loop,
    unsupported => NotSupported,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let os = std::io::Error::from_raw_os_error(self.errno());
        match (self.detail.is_empty(), self.kind) {
            (true, _) => write!(f, "{os}"),
            // The detail already says what went wrong with the medium.
            (false, ErrorKind::Io | ErrorKind::Corrupt) => write!(f, "{}", self.detail),
            (false, _) => write!(f, "{}: {os}", self.detail),
        }
    }
}

impl std::error::Error for Error {}

impl From<DevError> for Error {
    fn from(e: DevError) -> Error {
        // EIO also for a full host (ENOSPC under a sparse image): the write is lost and
        // the file system turns read-only, while ENOSPC means "refused, nothing
        // changed" to callers, who free space and retry.
        Error::io(format!("device: {e}"))
    }
}

impl From<FormatError> for Error {
    fn from(e: FormatError) -> Error {
        Error::corrupt(format!("corrupt metadata: {e}"))
    }
}

impl From<Error> for std::io::Error {
    fn from(e: Error) -> std::io::Error {
        std::io::Error::new(std::io::Error::from_raw_os_error(e.errno()).kind(), e.to_string())
    }
}
