package io.amqpsub.jmsconsumer;

import jakarta.jms.Connection;
import jakarta.jms.JMSException;
import jakarta.jms.Message;
import jakarta.jms.MessageConsumer;
import jakarta.jms.Session;
import java.net.URI;
import java.net.URISyntaxException;
import java.net.URLDecoder;
import java.nio.charset.StandardCharsets;
import org.apache.qpid.jms.JmsConnectionFactory;

/**
 * Receives exactly N messages from a queue over AMQP 1.0 with Qpid JMS, the
 * way a Java user would, for amqpsub's benchmark (integration/bench), which
 * compares it with its go-amqp loop.
 *
 * <p>One connection, one session, one consumer; synchronous {@code receive}
 * in a loop. The prefetch ({@code jms.prefetchPolicy.all}) is the link
 * credit: Qpid JMS grants it at attach and tops the credit back up to it once
 * it has fallen to half and at most 70% is outstanding or waiting to be
 * consumed. Every message is accepted on its own:
 *
 * <ul>
 *   <li>{@code --ack auto} (the default): AUTO_ACKNOWLEDGE, the JMS default;
 *       {@code receive} accepts the message (one AMQP disposition each)
 *       before it returns it.
 *   <li>{@code --ack individual}: Qpid JMS's INDIVIDUAL_ACKNOWLEDGE (101);
 *       {@code message.acknowledge()} on each accepts just that message.
 * </ul>
 *
 * <p>stdout carries one line per event, {@code <event> <System.nanoTime()>
 * <messages so far>}: {@code start} once the connection is open, before the
 * session and consumer are created (where the bench's go-amqp loop starts
 * its clock); {@code first} at the first message; {@code progress} every
 * 1,000 messages; {@code last} once the last was accepted. It exits 0 only
 * if N messages arrived and were accepted, 1 if none came for {@code
 * --stall} seconds or the connection failed, 2 on a usage error.
 *
 * <p>The URL comes from {@code --url}, else {@code $AMQPSUB_URL} (which keeps
 * a password off the command line), else amqp://127.0.0.1:5672; a user and
 * password in it become {@code jms.username} / {@code jms.password}.
 */
public final class Main {
  private static final int INDIVIDUAL_ACKNOWLEDGE = 101;
  private static final int PROGRESS_EVERY = 1000;

  private Main() {}

  public static void main(String[] args) throws Exception {
    System.setProperty("org.slf4j.simpleLogger.defaultLogLevel", "warn");
    String url = System.getenv().getOrDefault("AMQPSUB_URL", "amqp://127.0.0.1:5672");
    String queue = null;
    String ack = "auto";
    int count = -1;
    int prefetch = 256;
    int stall = 20;
    for (int i = 0; i < args.length; i++) {
      String a = args[i];
      if (i + 1 >= args.length) {
        usage("missing value for " + a);
      }
      String v = args[++i];
      switch (a) {
        case "--url" -> url = v;
        case "--queue" -> queue = v;
        case "--count" -> count = Integer.parseInt(v);
        case "--prefetch" -> prefetch = Integer.parseInt(v);
        case "--ack" -> ack = v;
        case "--stall" -> stall = Integer.parseInt(v);
        default -> usage("unknown argument " + a);
      }
    }
    if (queue == null || queue.isEmpty()) {
      usage("--queue is required");
    }
    if (count < 1 || prefetch < 1 || stall < 1) {
      usage("--count, --prefetch and --stall must be >= 1");
    }
    int mode = switch (ack) {
      case "auto" -> Session.AUTO_ACKNOWLEDGE;
      case "individual" -> INDIVIDUAL_ACKNOWLEDGE;
      default -> {
        usage("--ack must be auto or individual");
        yield 0;
      }
    };

    JmsConnectionFactory factory = factory(url, prefetch);
    int got = 0;
    try (Connection conn = factory.createConnection()) {
      // Qpid JMS opens the AMQP connection here, not in createConnection.
      conn.start();
      mark("start", 0);
      Session session = conn.createSession(false, mode);
      // createQueue: source capability "queue", an anycast queue on Artemis.
      MessageConsumer consumer = session.createConsumer(session.createQueue(queue));
      while (got < count) {
        Message m = consumer.receive(stall * 1000L);
        if (m == null) {
          System.err.printf("jms-consumer: no message for %d s after %d of %d%n", stall, got, count);
          System.exit(1);
        }
        if (mode == INDIVIDUAL_ACKNOWLEDGE) {
          m.acknowledge();
        }
        got++;
        if (got == 1) {
          mark("first", got);
        }
        if (got % PROGRESS_EVERY == 0) {
          mark("progress", got);
        }
      }
      mark("last", got);
    } catch (JMSException e) {
      System.err.printf("jms-consumer: after %d of %d messages: %s%n", got, count, e);
      System.exit(1);
    }
  }

  /** The factory for url, with its user and password moved to properties. */
  private static JmsConnectionFactory factory(String url, int prefetch) throws URISyntaxException {
    URI u = new URI(url);
    String user = null;
    String pass = null;
    if (u.getRawUserInfo() != null) {
      String[] up = u.getRawUserInfo().split(":", 2);
      user = URLDecoder.decode(up[0], StandardCharsets.UTF_8);
      pass = up.length > 1 ? URLDecoder.decode(up[1], StandardCharsets.UTF_8) : null;
    }
    String q = "jms.prefetchPolicy.all=" + prefetch;
    if (u.getRawQuery() != null && !u.getRawQuery().isEmpty()) {
      q = u.getRawQuery() + "&" + q;
    }
    int port = u.getPort() > 0 ? u.getPort() : 5672;
    JmsConnectionFactory f =
        new JmsConnectionFactory(u.getScheme() + "://" + u.getHost() + ":" + port + "?" + q);
    if (user != null) {
      f.setUsername(user);
      f.setPassword(pass);
    }
    return f;
  }

  private static void mark(String event, int n) {
    System.out.println(event + " " + System.nanoTime() + " " + n);
    System.out.flush();
  }

  private static void usage(String why) {
    System.err.println("jms-consumer: " + why);
    System.err.println("usage: java -jar jms-consumer.jar --queue Q --count N [--prefetch 256]"
        + " [--ack auto|individual] [--stall 20] [--url amqp://127.0.0.1:5672]");
    System.exit(2);
  }
}
