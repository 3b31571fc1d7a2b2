//! Generated from proto/generate.proto at build time.
#![allow(clippy::all)]

pub mod pb {
    tonic::include_proto!("pagemill.v1");
}
