//! The reply before encoding ([`Reply`]), the Extended DNS Error a
//! refusal carries, and the encoding of the response on the wire.

use std::net::SocketAddr;
use std::sync::Arc;

use hickory_server::net::xfer::Protocol;
use hickory_server::proto::op::{Edns, Header, HeaderCounts, Metadata, ResponseCode};
use hickory_server::proto::rr::rdata::opt::EdnsOption;
use hickory_server::proto::rr::Record;
use hickory_server::proto::serialize::binary::{BinEncodable, BinEncoder};
use hickory_server::server::Request;
use hickory_server::zone_handler::MessageResponseBuilder;
use tracing::warn;

use super::cache::Kept;
use super::refusals::Recorded;
use super::wire::{Question, Wire};
use crate::config::DnsDenied;
use crate::policy::{Reason, Verdict};

/// EDNS option code of an Extended DNS Error (RFC 8914).
pub(crate) const EDE_OPTION: u16 = 15;
/// EDE info-code 15, "Blocked".
pub(crate) const EDE_BLOCKED: u16 = 15;
/// EDE info-code 18, "Prohibited" (unknown clients).
pub(super) const EDE_PROHIBITED: u16 = 18;
/// Largest UDP payload we advertise and send (DNS flag day 2020).
pub(super) const MAX_UDP_PAYLOAD: u16 = 1232;

/// The answer to send, before encoding.
#[derive(Debug)]
pub(crate) struct Reply {
    pub(super) rcode: ResponseCode,
    pub(super) answers: Arc<[Record]>,
    pub(super) ede: Option<(u16, String)>,
    /// Seconds the answers' TTLs are counted down by when sent (a kept
    /// answer's age).
    pub(super) spent: u32,
}

impl Reply {
    pub(super) fn empty(rcode: ResponseCode) -> Reply {
        Reply {
            rcode,
            answers: Arc::new([]),
            ede: None,
            spent: 0,
        }
    }
}

fn ede_option(code: u16, text: &str) -> EdnsOption {
    let mut data = Vec::with_capacity(2 + text.len());
    data.extend_from_slice(&code.to_be_bytes());
    data.extend_from_slice(text.as_bytes());
    EdnsOption::Unknown(EDE_OPTION, data)
}

/// The rcode of a denied name, as the org wants it.
pub(super) fn denied_rcode(style: DnsDenied) -> ResponseCode {
    match style {
        DnsDenied::Refused => ResponseCode::Refused,
        DnsDenied::Nxdomain => ResponseCode::NXDomain,
    }
}

/// A refusal with its Extended DNS Error (naming its record, or saying it
/// was summarised).
pub(super) fn blocked(rcode: ResponseCode, verdict: &Verdict, recorded: &Recorded) -> Reply {
    let code = if verdict.reason == Reason::UnknownClient {
        EDE_PROHIBITED
    } else {
        EDE_BLOCKED
    };
    Reply {
        rcode,
        answers: Arc::new([]),
        ede: Some((
            code,
            format!("palisade: {}; {}", verdict.reason, recorded.reference()),
        )),
        spent: 0,
    }
}

/// The response to `request` carrying `reply`. Over UDP it is cut to what
/// the client can take (its EDNS payload size, at most
/// [`MAX_UDP_PAYLOAD`], else 512 bytes), with TC set when records did not
/// fit.
pub(super) fn encode(request: &Request, reply: &Reply, protocol: Protocol) -> Vec<u8> {
    let mut metadata = Metadata::response_from_request(&request.metadata);
    metadata.recursion_available = true;
    metadata.response_code = reply.rcode;
    let mut builder = MessageResponseBuilder::from_message_request(request);
    // Only our own EDNS goes back: client options (ECS, cookies,
    // unknown ones) are neither echoed nor forwarded.
    let edns = request.edns.as_ref().map(|req| {
        let mut e = Edns::new();
        e.set_max_payload(req.max_payload().clamp(512, MAX_UDP_PAYLOAD));
        e.set_version(0);
        if let Some((code, text)) = &reply.ede {
            e.options_mut().insert(ede_option(*code, text));
        }
        e
    });
    if let Some(e) = &edns {
        builder.edns(e);
    }
    let max = match (protocol, &edns) {
        (Protocol::Udp, Some(e)) => e.max_payload(),
        (Protocol::Udp, None) => 512,
        _ => u16::MAX,
    };
    let counted: Vec<Record>;
    let answers: &[Record] = if reply.spent == 0 {
        &reply.answers
    } else {
        counted = reply
            .answers
            .iter()
            .map(|r| {
                let mut r = r.clone();
                r.ttl = r.ttl.saturating_sub(reply.spent);
                r
            })
            .collect();
        &counted
    };
    let response = builder.build(metadata, answers.iter(), [], [], []);
    let mut bytes = Vec::with_capacity(512);
    let mut encoder = BinEncoder::new(&mut bytes);
    encoder.set_max_size(max);
    if let Err(e) = response.destructive_emit(&mut encoder) {
        warn!(error = %e, "dns: encoding the response failed; answering SERVFAIL");
        bytes.clear();
        metadata.response_code = ResponseCode::ServFail;
        let header = Header {
            metadata,
            counts: HeaderCounts::default(),
        };
        let mut encoder = BinEncoder::new(&mut bytes);
        if header.emit(&mut encoder).is_err() {
            bytes.clear();
        }
    }
    bytes
}

/// `reply` to the query `raw` (read from the wire, not yet by hickory):
/// hickory reads it and [`encode`] encodes the reply; nothing if it does
/// not read (never for a query [`super::wire::question`] accepts).
pub(super) fn encode_raw(
    raw: &[u8],
    src: SocketAddr,
    protocol: Protocol,
    reply: &Reply,
) -> Vec<u8> {
    match Request::from_bytes(raw.to_vec(), src, protocol) {
        Ok(request) => encode(&request, reply, protocol),
        Err(_) => Vec::new(),
    }
}

/// The response to the plain query `q` (`raw` on the wire) answered
/// `reply` from `kept`. When the reply is the kept answer itself, it is
/// built from the response kept on the wire for the query's shape and
/// transport; the first time, hickory encodes that response (TTLs as
/// kept) and it is kept for the next query. A reply that is not the kept
/// answer (refused, its record not written) is encoded by hickory.
pub(super) fn encode_kept(
    kept: &Kept,
    q: &Question<'_>,
    raw: &[u8],
    src: SocketAddr,
    protocol: Protocol,
    reply: &Reply,
) -> Vec<u8> {
    let tcp = protocol != Protocol::Udp;
    let plain = reply.ede.is_none() && reply.rcode == kept.fwd.rcode;
    if plain {
        if let Some(bytes) = kept.wire_answer(q, tcp, reply.spent) {
            return bytes;
        }
        let Ok(request) = Request::from_bytes(raw.to_vec(), src, protocol) else {
            return Vec::new();
        };
        let whole = Reply {
            rcode: reply.rcode,
            answers: reply.answers.clone(),
            ede: None,
            spent: 0,
        };
        let bytes = encode(&request, &whole, protocol);
        if let Some(wire) = Wire::new(q.shape, tcp, bytes, q.section.len()) {
            let answer = wire.answer(q, reply.spent);
            kept.keep_wire(wire);
            if let Some(answer) = answer {
                return answer;
            }
        }
        return encode(&request, reply, protocol);
    }
    encode_raw(raw, src, protocol, reply)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ede_bytes() {
        let EdnsOption::Unknown(code, data) = ede_option(15, "x") else {
            panic!("not an unknown option")
        };
        assert_eq!(code, 15);
        assert_eq!(data, vec![0, 15, b'x']);
    }
}
