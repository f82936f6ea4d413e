//! A shard's side of the mesh between shards: it carries out the messages
//! other shards send it (inputs for `Control`, its actions, runs to start,
//! credit, control frames, command answers, queries, lifecycle steps).

use std::rc::Rc;

use iop_engine::mailbox::Mailbox;
use iop_wire::pb;
use iop_wire::pb::frame::Body;

use crate::control::ConnId;
use crate::link::commands;
use crate::link::edge::Edge;
use crate::link::replies::ReplyEvent;
use crate::link::shards::{self, ShardMsg};

impl Edge {
    /// Hands an admin command's answer to the shard whose client asked.
    pub fn forward_command_answer(
        &self,
        to: usize,
        conn: ConnId,
        response: pb::NodeCommandResponse,
    ) {
        match &self.outbox {
            Some(outbox) if to != self.shard => {
                outbox.send(to, ShardMsg::CommandAnswer { conn, response })
            }
            _ => commands::on_response(conn, response),
        }
    }

    /// Carries out one message from another shard.
    pub fn on_message(self: &Rc<Self>, msg: ShardMsg) {
        match msg {
            ShardMsg::Inputs(inputs) => self.apply_batch(inputs),
            ShardMsg::Actions(actions) => {
                for action in actions {
                    self.execute_here(action);
                }
            }
            ShardMsg::StartAttempt(start) => {
                let edge = self.clone();
                monoio::spawn(async move {
                    let (request, reply) = (start.request, start.reply.clone());
                    if !edge.send_attempt_here(start).await {
                        edge.abandon(request);
                        let _ = reply.send(ReplyEvent::Lost).await;
                    }
                });
            }
            ShardMsg::Credit {
                conn,
                run_id,
                max_offset,
            } => self.credit_here(conn, &run_id, max_offset),
            ShardMsg::SendControl { conn, frame } => {
                let command_id = match &frame.body {
                    Some(Body::NodeCommandRequest(c))
                        if commands::is_admin_command(&c.command_id) =>
                    {
                        Some(c.command_id.clone())
                    }
                    _ => None,
                };
                let sent = self
                    .conn(conn)
                    .is_some_and(|c| c.send_control(frame).is_ok());
                if let (false, Some(command_id)) = (sent, command_id) {
                    let to = commands::command_shard(&command_id);
                    match &self.outbox {
                        Some(outbox) if to != self.shard => {
                            outbox.send(to, ShardMsg::CommandUndeliverable { conn, command_id })
                        }
                        _ => commands::on_undeliverable(conn, &command_id),
                    }
                }
            }
            ShardMsg::CommandUndeliverable { conn, command_id } => {
                commands::on_undeliverable(conn, &command_id)
            }
            ShardMsg::CommandAnswer { conn, response } => commands::on_response(conn, response),
            ShardMsg::Query(read) => match &self.control {
                Some(control) => read(&control.borrow()),
                None => tracing::error!(shard = self.shard, "control query sent to a worker shard"),
            },
            ShardMsg::Lifecycle(step) => {
                self.lifecycle.borrow_mut().push(step);
                self.lifecycle_changed.wake_all();
            }
            ShardMsg::Drained { in_flight } => {
                let (shards, cut_off) = self.drained.get();
                self.drained.set((shards + 1, cut_off + in_flight));
                self.lifecycle_changed.wake_all();
            }
        }
    }

    /// Runs this shard's mesh: the outbox flusher and the inbox (spawn once
    /// per shard; never returns).
    pub async fn run_mesh(self: Rc<Self>, inbox: Mailbox<ShardMsg>) {
        let inbox_task = {
            let edge = self.clone();
            shards::run_inbox(inbox, move |msg| edge.on_message(msg))
        };
        match &self.outbox {
            Some(outbox) => {
                monoio::select! {
                    _ = outbox.run() => {},
                    _ = inbox_task => {},
                }
            }
            None => inbox_task.await,
        }
    }
}
