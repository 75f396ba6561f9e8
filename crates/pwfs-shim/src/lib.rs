//! pwfs-shim: how the LD_PRELOAD shim (`libpwfs_preload.so`, crate `pwfs-preload`)
//! carries the data calls of files on a Patchwork mount to the mount's daemon without
//! a FUSE round trip (docs/SHIM.md).
//!
//! - [`proto`]: the wire. A UNIX seqpacket socket per client process (the *session*:
//!   hello, registration of a file descriptor, a new channel), and a shared memory
//!   *channel* per client thread: one request slot and a data area, a futex word
//!   whose owner alternates between the two sides. Both sides spin on it for a bounded
//!   time before they sleep, so a request between busy sides makes no system call.
//! - [`server`] (feature `server`): the daemon side, serving a [`pwfs::Fs`].
//!
//! The namespace stays with the mount: a client opens, renames and stats through the
//! kernel, and registers an open file descriptor (passed over the socket: holding it
//! is the proof that the kernel let the client open the file) before it carries that
//! file's data calls here.

pub mod proto;
#[cfg(feature = "server")]
pub mod server;
