package io.amqpsub.jmsproducer;

import jakarta.jms.BytesMessage;
import jakarta.jms.CompletionListener;
import jakarta.jms.Connection;
import jakarta.jms.DeliveryMode;
import jakarta.jms.JMSException;
import jakarta.jms.MapMessage;
import jakarta.jms.Message;
import jakarta.jms.MessageProducer;
import jakarta.jms.Queue;
import jakarta.jms.Session;
import jakarta.jms.StreamMessage;
import java.nio.charset.StandardCharsets;
import java.util.List;
import java.util.concurrent.Semaphore;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;
import org.apache.qpid.jms.JmsConnectionFactory;

/**
 * Sends N messages in message groups to a queue over AMQP 1.0 with Qpid JMS,
 * for amqpsub's integration tests.
 *
 * <p>Message i (from 0) belongs to group {@code g%03d} with g = i mod groups,
 * and carries JMSXGroupID = that name and JMSXGroupSeq = its 1-based position
 * in the group. Its body depends on the kind, with key = "group/seq":
 *
 * <ul>
 *   <li>text: TextMessage(key)
 *   <li>bytes: BytesMessage with the UTF-8 bytes of key
 *   <li>map: MapMessage {key: key, seq: int, big: long 2^40, flag: seq even,
 *       half: seq/2.0 (double), raw: bytes 1,2,3}
 *   <li>stream: StreamMessage key, seq (int), true, bytes 1,2,3, 0.5 (double)
 *   <li>object: ObjectMessage(key), a serialized java.lang.String
 *   <li>mixed: message i of a group takes kind (i / groups) mod 5 in the
 *       order text, bytes, map, stream, object
 *   <li>map-char: MapMessage {key: key, c: char 'x'} (AMQP char, which some
 *       clients cannot decode)
 * </ul>
 *
 * <p>Every message also has the string property "kind" and the int property
 * "n" (i). Sends are persistent and asynchronous (at most 256 in flight, in
 * order on one link); the program waits for the broker to accept every one,
 * so when it exits 0 the broker holds every message.
 */
public final class Main {
  private static final List<String> MIXED = List.of("text", "bytes", "map", "stream", "object");
  private static final List<String> KINDS =
      List.of("text", "bytes", "map", "stream", "object", "mixed", "map-char");

  private static final int WINDOW = 256;

  private Main() {}

  public static void main(String[] args) throws Exception {
    System.setProperty("org.slf4j.simpleLogger.defaultLogLevel", "warn");
    String url = "amqp://127.0.0.1:5672";
    String queue = null;
    String kind = "text";
    int count = 100;
    int groups = 10;
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
        case "--groups" -> groups = Integer.parseInt(v);
        case "--kind" -> kind = v;
        default -> usage("unknown argument " + a);
      }
    }
    if (queue == null || queue.isEmpty()) {
      usage("--queue is required");
    }
    if (count < 0 || groups < 1) {
      usage("--count must be >= 0 and --groups >= 1");
    }
    if (!KINDS.contains(kind)) {
      usage("--kind must be one of " + KINDS);
    }

    long start = System.nanoTime();
    JmsConnectionFactory factory = new JmsConnectionFactory(url);
    try (Connection conn = factory.createConnection()) {
      Session session = conn.createSession(false, Session.AUTO_ACKNOWLEDGE);
      // Qpid JMS attaches the sender with target capability "queue", so
      // Artemis auto-creates an anycast queue.
      Queue dest = session.createQueue(queue);
      MessageProducer producer = session.createProducer(dest);
      producer.setDeliveryMode(DeliveryMode.PERSISTENT);
      Semaphore window = new Semaphore(WINDOW);
      AtomicReference<Exception> failed = new AtomicReference<>();
      CompletionListener done = new CompletionListener() {
        @Override
        public void onCompletion(Message m) {
          window.release();
        }

        @Override
        public void onException(Message m, Exception e) {
          failed.compareAndSet(null, e);
          window.release();
        }
      };
      int[] next = new int[groups];
      for (int i = 0; i < count; i++) {
        int g = i % groups;
        String group = String.format("g%03d", g);
        int seq = ++next[g];
        String k = kind.equals("mixed") ? MIXED.get((i / groups) % MIXED.size()) : kind;
        Message m = build(session, k, group + "/" + seq, seq);
        m.setStringProperty("JMSXGroupID", group);
        m.setIntProperty("JMSXGroupSeq", seq);
        m.setStringProperty("kind", k);
        m.setIntProperty("n", i);
        acquire(window, 1);
        if (failed.get() != null) {
          throw failed.get();
        }
        producer.send(m, done);
      }
      acquire(window, WINDOW);
      if (failed.get() != null) {
        throw failed.get();
      }
    }
    System.out.printf("sent %d messages in %d groups (kind %s) to %s in %d ms%n",
        count, groups, kind, queue, (System.nanoTime() - start) / 1_000_000);
  }

  private static void acquire(Semaphore window, int n) throws InterruptedException {
    if (!window.tryAcquire(n, 60, TimeUnit.SECONDS)) {
      throw new IllegalStateException("the broker did not accept the messages sent within 60 s");
    }
  }

  private static Message build(Session s, String kind, String key, int seq) throws JMSException {
    byte[] raw = {1, 2, 3};
    switch (kind) {
      case "text":
        return s.createTextMessage(key);
      case "bytes": {
        BytesMessage m = s.createBytesMessage();
        m.writeBytes(key.getBytes(StandardCharsets.UTF_8));
        return m;
      }
      case "map": {
        MapMessage m = s.createMapMessage();
        m.setString("key", key);
        m.setInt("seq", seq);
        m.setLong("big", 1L << 40);
        m.setBoolean("flag", seq % 2 == 0);
        m.setDouble("half", seq / 2.0);
        m.setBytes("raw", raw);
        return m;
      }
      case "stream": {
        StreamMessage m = s.createStreamMessage();
        m.writeString(key);
        m.writeInt(seq);
        m.writeBoolean(true);
        m.writeBytes(raw);
        m.writeDouble(0.5);
        return m;
      }
      case "object":
        return s.createObjectMessage(key);
      case "map-char": {
        MapMessage m = s.createMapMessage();
        m.setString("key", key);
        m.setChar("c", 'x');
        return m;
      }
      default:
        throw new IllegalArgumentException("kind " + kind);
    }
  }

  private static void usage(String why) {
    System.err.println("jms-producer: " + why);
    System.err.println("usage: java -jar jms-producer.jar --queue Q [--url amqp://127.0.0.1:5672]"
        + " [--count 100] [--groups 10] [--kind " + String.join("|", KINDS) + "]");
    System.exit(2);
  }
}
