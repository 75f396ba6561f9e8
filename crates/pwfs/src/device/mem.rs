//! In-memory engine: a byte vector. Flush is a no-op; nothing survives the process.

use super::{validate, DevError, Device, Done, Op, OpKind};
use parking_lot::RwLock;

pub struct MemDevice {
    data: RwLock<Vec<u8>>,
}

impl MemDevice {
    pub fn new(len: u64) -> MemDevice {
        MemDevice { data: RwLock::new(vec![0; len as usize]) }
    }
    pub fn from_vec(data: Vec<u8>) -> MemDevice {
        MemDevice { data: RwLock::new(data) }
    }
    pub fn snapshot(&self) -> Vec<u8> {
        self.data.read().clone()
    }
}

/// Copy a validated read op's bytes out of an image.
pub(crate) fn read_from(image: &[u8], op: &mut Op) {
    let mut at = op.offset as usize;
    for b in op.bufs.iter_mut() {
        let n = b.len();
        b.copy_from_slice(&image[at..at + n]);
        at += n;
    }
}

/// Copy a validated write op's bytes into an image.
pub(crate) fn write_to(image: &mut [u8], op: &Op) {
    let mut at = op.offset as usize;
    for b in op.bufs.iter() {
        image[at..at + b.len()].copy_from_slice(b);
        at += b.len();
    }
}

impl Device for MemDevice {
    fn len(&self) -> u64 {
        self.data.read().len() as u64
    }

    fn submit(&self, ops: Vec<Op>) -> Vec<Done> {
        ops.into_iter()
            .map(|mut op| {
                let result = match op.kind {
                    OpKind::Read => {
                        let d = self.data.read();
                        validate(&op, d.len() as u64).map(|_| read_from(&d, &mut op))
                    }
                    OpKind::Write => {
                        let mut d = self.data.write();
                        let n = d.len() as u64;
                        validate(&op, n).map(|_| write_to(&mut d, &op))
                    }
                };
                Done { bufs: op.bufs, result }
            })
            .collect()
    }

    fn flush(&self) -> Result<(), DevError> {
        Ok(())
    }

    fn name(&self) -> &'static str {
        "mem"
    }
}
